"""Load testing end to end: a short smoke run of the benchmark, and locust against the edge."""

from __future__ import annotations

import csv
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devstack.stack import Stack
from loadtest.workloads.prompts import Conversation, system_prompt, user_text
from tests.conftest import ROOT, started

pytestmark = pytest.mark.timeout(400)


def test_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out"
    scratch = Path(tempfile.mkdtemp(prefix="t"))  # short: unix socket paths live under it
    scratch.chmod(0o755)  # NGINX's workers (nobody) read the Lua files under it
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.bench",
            "--systems",
            "fifo,vllm_router,admission",
            "--nodes",
            "2",
            "--seconds",
            "6",
            "--load",
            "1.0",
            "--workload",
            str(ROOT / "loadtest/workloads/support.yaml"),
            "--out",
            str(out),
            "--trace",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=360,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    left = list(scratch.glob("bench-*"))
    shutil.rmtree(scratch)
    assert not left  # its scratch directory is gone
    doc = json.loads((out / "report.json").read_text())
    systems = [s["system"] for s in doc["summaries"]]
    assert systems == ["fifo", "vllm_router", "admission"]  # vLLM's router, the real program
    for s in doc["summaries"]:
        assert s["lost"] == 0
        assert s["classes"]["realtime"]["sent"] > 0
        assert s["goodput_tokens_per_s"] > 0
        # Per-tenant system prompts: every system's engines found some of them cached.
        assert s["prefix_hit_ratio"] is not None and s["prefix_hit_ratio"] > 0.1
        # ... and per class, from each answer's usage (cached_tokens): realtime's share of
        # its prompts is at most 1, and some of it was cached.
        hits = s["classes"]["realtime"]["prefix_hits"]
        assert hits is not None and 0.1 < hits <= 1.0
    assert "| admission | realtime |" in (out / "report.md").read_text()
    assert "offered compute, share of the cluster at roofline cost: realtime" in proc.stdout
    assert "batch with a first token in time behind realtime: at most" in proc.stdout
    for s in doc["summaries"]:
        assert s["good_tokens"] == pytest.approx(s["goodput_tokens_per_s"] * s["seconds"])
    for name in ("ttft_cdf.png", "shares.png", "timeline.png"):
        assert (out / name).stat().st_size > 1000
    # --trace: the admission sidecar's status twice a second, its node views in each line.
    lines = [json.loads(ln) for ln in (out / "status-round-0.jsonl").read_text().splitlines()]
    assert len(lines) >= 6 and all(len(ln["status"]["nodes"]) == 2 for ln in lines)
    assert max(ln["t"] for ln in lines) >= 5


def bench(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a benchmark module as a user does; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.skipif(
    shutil.which("wrk") is None, reason="wrk missing (scripts/setup.sh installs it)"
)
def test_benchmark_stopped_by_sigterm_stops_what_it_started(tmp_path: Path) -> None:
    # `kill` (SIGTERM) of a running benchmark: its nodes, Redis, NGINX and sidecars (each in a
    # session of its own) are stopped, as on Ctrl-C; before, the whole stack kept running.
    scratch = Path(tempfile.mkdtemp(prefix="t"))  # short: unix socket paths live under it
    scratch.chmod(0o755)
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "loadtest.bench", "--systems", "admission"),
            *("--nodes", "2", "--seconds", "60", "--out", str(tmp_path / "out")),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TMPDIR": str(scratch)},
    )

    def children() -> list[int]:
        """Live processes the benchmark started (their parent is the benchmark)."""
        pids = []
        for d in Path("/proc").iterdir():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if d.name.isdigit() and int(stat[1]) == proc.pid and stat[0] != "Z":
                pids.append(int(d.name))
        return pids

    def alive(pid: int) -> bool:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state != "Z"

    pids: list[int] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the stack is up once the load starts
            if line.startswith("running admission"):
                break
        time.sleep(2.0)
        pids = children()
        assert len(pids) >= 5, pids  # 2 nodes, Redis, a sidecar, the agent, NGINX
        proc.terminate()
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 15
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.returncode == 143
        assert not [p for p in pids if alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:  # each leads a session of its own: its group holds its children
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(scratch, ignore_errors=True)


def test_throughput_benchmark_smoke() -> None:
    """The edge throughput benchmark runs end to end: both paths answer 200 at every step, and
    the per-process CPU table names the sidecars, Redis, NGINX and the client."""
    proc = bench("loadtest.bench_throughput", "--seconds", "2", "--clients", "32", "--idle-s", "1")
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| full edge | 32 clients")]
    assert len(rows) == 2  # the throughput row and the CPU row
    assert "× 200 |" in rows[0] and "admission_unavailable" not in rows[0]
    assert int(rows[0].split("|")[3].replace(",", "")) > 0
    header = next(ln for ln in proc.stdout.splitlines() if ln.startswith("| path | load | redis"))
    for role in ("sidecar", "edge nginx", "redis", "wrk (client)"):
        assert role in header


def test_scratch_kept_when_asked_or_when_the_run_failed(tmp_path: Path) -> None:
    code = (
        "import sys; from loadtest.benchmark.scratch import keep, scratch; "
        "w = scratch('bench-t-', {keep}); (w / 'log').write_text('x'); "
        "keep(w) if {found} else None; sys.exit(0) if {ok} else 1 / 0"
    )
    for keep, found, ok, kept in (
        (False, False, True, False),
        (True, False, True, True),
        (False, False, False, True),
        (False, True, True, True),
    ):
        d = tmp_path / f"{keep}-{found}-{ok}"
        d.mkdir()
        proc = subprocess.run(
            [sys.executable, "-c", code.format(keep=keep, found=found, ok=ok)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "TMPDIR": str(d)},
        )
        assert (proc.returncode == 0) is ok
        assert [p.name for p in d.glob("bench-t-*/log")] == (["log"] if kept else [])
        assert ("scratch directory kept" in proc.stderr) is kept


def test_edge_latency_benchmark_smoke() -> None:
    """bench_edge runs end to end on the NGINX stub: both paths answer, the added latency is
    printed, and so is how much of it the sidecar's own histograms account for."""
    proc = bench("loadtest.bench_edge", "--rate", "50", "--seconds", "2", "--stub", "nginx")
    rows = {
        ln.split()[0] + " " + ln.split()[1]: ln.split()
        for ln in proc.stdout.splitlines()
        if ln.startswith(("nginx direct", "nginx + admission"))
    }
    assert rows["nginx direct"][2:4] == ["100", "0"] and rows["nginx +"][3:5] == ["100", "0"]
    inside = next(ln for ln in proc.stdout.splitlines() if ln.startswith("inside the sidecar"))
    assert "over 100 " in inside  # one decision per request sent through the edge
    trips = next(ln for ln in proc.stdout.splitlines() if ln.startswith("of which Redis"))
    assert float(trips.split("mean ")[1].split(" ms")[0]) > 0
    # Redis's own CPU per script call, and the admissions answered ahead of their round trip
    # (at 50 req/s on one tenant and one node nearly all are; none went past a limit).
    cpu = next(ln for ln in proc.stdout.splitlines() if ln.startswith("inside Redis"))
    assert "evalsha " in cpu
    ahead = next(ln for ln in proc.stdout.splitlines() if ln.startswith("answered ahead"))
    counts = dict(part.rsplit(" ", 1) for part in ahead.split(":", 1)[1].strip().split(", "))
    assert int(counts["confirmed"].replace(",", "")) >= 80, ahead
    assert counts["over_limits"] == counts["over_node"] == counts["unconfirmed"] == "0", ahead


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from started(tmp_path_factory, "locust-stack", nodes=1, sidecars=1)


def test_locust_headless_reports_ttft_per_class(stack: Stack, tmp_path: Path) -> None:
    prefix = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(ROOT / "loadtest" / "locustfile.py"),
            "--host",
            stack.url,
            "--headless",
            "-u",
            "6",
            "-r",
            "6",
            "-t",
            "6s",
            "--csv",
            str(prefix),
            "--only-summary",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "LOCUST_THINK_S": "0.2"},
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: some requests failed (429s count)
    with (tmp_path / "run_stats.csv").open() as f:
        rows = list(csv.DictReader(f))
    names = {(r["Type"], r["Name"]) for r in rows}
    assert ("TTFT", "realtime") in names, names
    ttft = next(r for r in rows if (r["Type"], r["Name"]) == ("TTFT", "realtime"))
    assert int(ttft["Request Count"]) > 5 and float(ttft["Median Response Time"]) > 0
    assert any(n[1].startswith("chat ") for n in names)
    # The prompts repeat what production's do (system prompts, a conversation's history), and
    # only that: the node's prefix cache found part of them, not all (all the same filler text
    # once made every prompt a cache hit, and locust's capacity the cache's best case).
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.node_ports[0]}/metrics") as r:
        metrics = r.read().decode()
    hits, queries = (
        sum(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith(f"{name}_total"))
        for name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries")
    )
    print(f"prefix cache hits: {hits / max(queries, 1):.1%} of {queries:.0f} prompt tokens")
    assert queries > 0 and 0.2 < hits / queries < 0.9, (hits, queries)


class _Recorder(http.server.BaseHTTPRequestHandler):
    """An OpenAI-shaped stub that keeps every chat body it is sent, answers each with a text of
    its own (`answer-<n>`, streamed in two pieces) and refuses every fourth with 429."""

    bodies: list[dict[str, Any]] = []
    answers: dict[str, str] = {}  # a request's last user message -> the answer it was given
    refused: set[str] = set()

    def log_message(self, *_a: object) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200, json.dumps({"data": [{"id": "stub"}]}).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = len(self.bodies)
        self.bodies.append(body)
        question = body["messages"][-1]["content"]
        if n % 4 == 3:
            self.refused.add(question)
            self._send(429, json.dumps({"error": {"code": "slo_unreachable"}}).encode())
            return
        self.answers[question] = f"answer-{n}"
        chunks = [
            {"choices": [{"index": 0, "delta": {"content": piece}}]}
            for piece in ("answer", f"-{n}")
        ]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._send(200, sse.encode(), "text/event-stream")


def test_locust_chat_users_hold_conversations(tmp_path: Path) -> None:
    """The chat users' turns, as an engine receives them: each resends the answered history
    with the answers as they were streamed, a refused question is never resent, conversations
    end after LOCUST_TURNS turns, and every prompt starts with one of a few system prompts."""
    _Recorder.bodies, _Recorder.answers, _Recorder.refused = [], {}, set()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py")),
                *("--host", f"http://127.0.0.1:{server.server_port}", "--headless"),
                *("-u", "3", "-r", "3", "-t", "4s", "--only-summary", "ChatUser"),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "LOCUST_THINK_S": "0.02", "LOCUST_TURNS": "3"},
        )
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: the stub's 429s count as failures
    bodies = _Recorder.bodies
    assert len(bodies) > 30, len(bodies)
    later = 0
    for body in bodies:
        msgs = body["messages"]
        assert msgs[0]["role"] == "system" and msgs[-1]["role"] == "user", msgs
        assert len(msgs) <= 2 * 3, len(msgs)  # at most 2 answered turns before the third
        for q, a in zip(msgs[1:-1:2], msgs[2:-1:2], strict=True):
            assert q["role"] == "user" and a["role"] == "assistant"
            assert q["content"] not in _Recorder.refused
            assert _Recorder.answers[q["content"]] == a["content"]  # as it was streamed
            later += 1
    assert later > 10, later
    systems = {b["messages"][0]["content"] for b in bodies}
    assert len(systems) <= 4 * 3 and len(systems) < len(bodies) / 3, len(systems)


def test_locust_prompts_repeat_what_production_repeats() -> None:
    """System prompts are the same text every time, distinct per tenant, kind and index; a
    user's text is new from its first characters; each turn resends the answered history, and
    a refused turn is not in it."""
    a = system_prompt("acme", "chat", 0, 512)
    assert a == system_prompt("acme", "chat", 0, 512)
    others = {system_prompt(*k, 512) for k in [("acme", "chat", 1), ("globex", "chat", 0)]}
    assert len({a, system_prompt("acme", "summarise", 0, 512), *others}) == 4
    assert 1900 <= len(a) <= 2200, len(a)  # ~4 characters a token, as the edge counts
    u, v = user_text(300), user_text(300)
    assert u[:4] != v[:4] and 1100 <= len(u) <= 1300, u[:40]
    chat = Conversation(a)
    first = chat.ask("q1")
    assert first == [{"role": "system", "content": a}, {"role": "user", "content": "q1"}]
    chat.answered("q1", "a1")
    chat.ask("q2")  # refused: never answered
    third = chat.ask("q3")
    assert third == [
        *first,
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q3"},
    ]
    assert chat.turns == 1
