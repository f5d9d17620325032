"""Chaos suite: faults injected under open-loop load through the real edge.

One stack (redis-server, NGINX + ngx_lua, two sidecars, the node agent, two emulated vLLM
nodes), supervised the way `admission up` does it. Each test drives open-loop traffic (streamed
and plain requests from a realtime and an offline tenant) and injects one fault mid-run. After
each:
- every request got a defined answer: 200 with a complete body, or an OpenAI-shaped JSON error
  whose code is one the docs list (no reset, no HTML page, no undocumented 5xx); a stream cut
  mid-way is allowed only where an engine node was killed under it;
- once traffic stops, nothing is left booked in Redis (node leases, ledger KV, concurrency
  slots, reservations): checked on the keys themselves, not left to their TTLs;
- every sidecar's dispatcher is alive and `/healthz` says so.

`pytest -m chaos -s` prints one line per fault (answers by kind, recovery time): the figures in
docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from devstack.probes import log_findings, sidecar_health, unix_get, wait_unbooked
from devstack.stack import Stack
from tests.conftest import started

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

# Codes an error answer may carry under these faults (docs/operations.md, "Failure modes"): policy refusals
# (429) and the documented unavailability answers (503), and the JSON the edge makes of an
# engine that failed before answering (502/504).
REFUSALS = {
    "requests_per_s",
    "tokens_per_min",
    "burst",
    "concurrency",
    "queue_full",
    "tenant_queue_full",
    "slo_unreachable",
    "over_fair_share",
    "request_exceeds_limit",
}
UNAVAILABLE = {
    "admission_unavailable",
    "limiter_unavailable",
    "admission_busy",
    "sidecar_overloaded",
    "queue_timeout",
    "engine_unavailable",
    "engine_timeout",
}
KEYS = ("sk-demo-acme", "sk-demo-etl")


@dataclass
class Answer:
    start: float  # seconds since the load began
    status: int  # 0: no HTTP answer at all
    kind: str  # ok | refused | unavailable | cut | aborted | undefined
    detail: str = ""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from started(tmp_path_factory, "chaos", supervised=True, nodes=2, sidecars=2)


def body(rng: random.Random, stream: bool) -> dict[str, Any]:
    return {
        "model": "llama-3-8b",
        "messages": [{"role": "user", "content": "tell me something " * rng.randint(1, 40)}],
        "max_tokens": rng.randint(8, 48),
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


def classify(status: int, raw: bytes) -> tuple[str, str]:
    if status == 200:
        return "ok", ""
    try:
        code = json.loads(raw)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return "undefined", f"{status} {raw[:80]!r}"
    if status == 429 and code in REFUSALS:
        return "refused", code
    if status == 503 and code == "no_capacity":  # every node drained: a refusal, said as such
        return "refused", code
    if status in (502, 503, 504) and code in UNAVAILABLE:
        return "unavailable", code
    return "undefined", f"{status} {code}"


async def one(
    s: aiohttp.ClientSession, url: str, t0: float, rng: random.Random, abort_frac: float
) -> Answer:
    start = time.monotonic() - t0
    stream = rng.random() < 0.5
    abort = stream and rng.random() < abort_frac
    headers = {"Authorization": f"Bearer {rng.choice(KEYS)}"}
    try:
        async with s.post(
            f"{url}/v1/chat/completions", json=body(rng, stream), headers=headers
        ) as r:
            if r.status != 200:
                kind, detail = classify(r.status, await r.read())
                return Answer(start, r.status, kind, detail)
            if abort:
                await r.content.readany()  # the first bytes, then the client goes away
                r.close()
                return Answer(start, 200, "aborted")
            data = await r.read()
            if stream and not data.rstrip().endswith(b"data: [DONE]"):
                return Answer(start, 200, "cut", "stream ended without [DONE]")
            if not stream and "choices" not in json.loads(data):
                return Answer(start, 200, "undefined", "200 without choices")
            return Answer(start, 200, "ok")
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        return Answer(start, 0, "cut", type(exc).__name__)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Answer(start, 0, "undefined", f"{type(exc).__name__}: {exc}")


def open_loop(
    stack: Stack,
    *,
    rate: float,
    seconds: float,
    faults: list[tuple[float, Callable[[], None]]],
    abort_frac: float = 0.0,
    seed: int = 1,
) -> list[Answer]:
    """Poisson arrivals at `rate` for `seconds`; each fault runs once at its time (in a thread,
    so the load keeps its pace). Returns every request's answer."""

    async def main() -> list[Answer]:
        rng = random.Random(seed)
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=90)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
            t0 = time.monotonic()
            loop = asyncio.get_running_loop()
            pending: list[asyncio.Future[None]] = []
            for at, fault in faults:
                pending.append(asyncio.ensure_future(_later(loop, t0 + at, fault)))
            tasks = []
            t = 0.0
            while True:
                t += rng.expovariate(rate)
                if t > seconds:
                    break
                await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
                tasks.append(asyncio.ensure_future(one(s, stack.url, t0, rng, abort_frac)))
            answers = await asyncio.gather(*tasks)
            await asyncio.gather(*pending)
            return list(answers)

    return asyncio.run(main())


async def _later(loop: asyncio.AbstractEventLoop, at: float, fault: Callable[[], None]) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    await loop.run_in_executor(None, fault)


def redis_client(stack: Stack) -> redis.Redis:
    assert stack.redis_url is not None
    return redis.Redis.from_url(stack.redis_url, socket_timeout=2)


def settle_and_check(
    stack: Stack, answers: list[Answer], allow: set[str], label: str, fault_at: float
) -> None:
    kinds = Counter(a.kind for a in answers)
    bad = [a for a in answers if a.kind not in allow | {"ok", "refused", "unavailable"}]
    # Recovery: from the fault to the start of the last request that was not answered 200
    # (refusals by rate limit are the policy working, not a failure).
    failed = [
        a.start
        for a in answers
        if a.kind in ("unavailable", "cut", "undefined") and a.start >= fault_at - 2
    ]
    recovery = max(failed) - fault_at if failed else 0.0
    assert stack.redis_url is not None
    left = wait_unbooked(stack.redis_url)
    health = sidecar_health(stack.sock_dir)
    # No unhandled exception in any sidecar: a 500 would be retried by the edge and so stay
    # invisible to clients, but it is a bug (the logs are appended to over the module).
    findings = log_findings(stack.run_dir, set(KEYS))
    codes = Counter(a.detail for a in answers if a.kind in ("refused", "unavailable"))
    print(
        f"\nCHAOS {label}: {len(answers)} requests, {dict(kinds)}; codes {dict(codes)}; "
        f"recovery {max(recovery, 0.0):.1f} s; left in Redis {len(left)}"
    )
    assert not bad, bad[:10]
    assert kinds["ok"] > len(answers) // 3, kinds
    assert not left, left
    assert not findings, findings
    assert len(health) == 2 and all(h == (200, "ok") for h in health), health


def redis_errors(stack: Stack) -> float:
    """admission_redis_errors_total of the admin sidecar, all operations."""
    with urllib.request.urlopen(f"{stack.sidecar_url}/metrics", timeout=5) as m:
        lines = m.read().decode().splitlines()
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in lines
        if ln.startswith("admission_redis_errors_total{")
    )


def admin(stack: Stack, node: str, action: str) -> None:
    req = urllib.request.Request(
        f"{stack.sidecar_url}/nodes/{node}/{action}",
        method="POST",
        data=b"",
        headers={"Authorization": f"Bearer {stack.admin_token}"},
    )
    urllib.request.urlopen(req, timeout=5).close()


def pid_of(stack: Stack, name: str) -> int:
    return dict(stack.procs)[name].pid


def wait_restarted(stack: Stack, name: str, old_pid: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if dict(stack.procs)[name].pid != old_pid:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} was not restarted")


def test_baseline_without_faults(stack: Stack) -> None:
    answers = open_loop(stack, rate=12, seconds=5, faults=[])
    settle_and_check(stack, answers, set(), "no fault", 0.0)
    assert all(a.kind == "ok" for a in answers), Counter(a.kind for a in answers)


def test_redis_killed_mid_run(stack: Stack) -> None:
    old = pid_of(stack, "redis")
    errors = redis_errors(stack)
    answers = open_loop(
        stack, rate=12, seconds=8, faults=[(2.0, lambda: os.kill(old, signal.SIGKILL))]
    )
    wait_restarted(stack, "redis", old)
    settle_and_check(stack, answers, set(), "kill -9 redis-server", 2.0)
    assert redis_errors(stack) > errors  # the fault was felt, and lived through


def test_sidecar_killed_with_requests_queued(stack: Stack) -> None:
    """Both nodes drained so that requests queue in the sidecars; one sidecar is killed; the
    edge re-asks the other (keeping arrival time): the waiting clients get answers."""
    for n in ("node-0", "node-1"):
        admin(stack, n, "drain")
    old = pid_of(stack, "sidecar-1")
    queued_at_kill: list[int] = []

    def kill() -> None:
        queued_at_kill.append(unix_get(stack.sock_dir / "sidecar-1.sock", "/healthz")[1]["queued"])
        os.kill(old, signal.SIGKILL)

    def undrain() -> None:
        for n in ("node-0", "node-1"):
            admin(stack, n, "undrain")

    answers = open_loop(stack, rate=8, seconds=4, faults=[(2.0, kill), (3.0, undrain)])
    wait_restarted(stack, "sidecar-1", old)
    deadline = time.monotonic() + 20
    while not (stack.sock_dir / "sidecar-1.sock").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    settle_and_check(stack, answers, set(), "kill -9 one of two sidecars, requests queued", 2.0)
    assert queued_at_kill and queued_at_kill[0] > 0, queued_at_kill
    early = [a for a in answers if a.start < 2.0]
    assert early and all(a.kind in ("ok", "refused") for a in early), early


def test_node_killed_mid_stream(stack: Stack) -> None:
    assert stack.nodes is not None
    old = stack.nodes.procs[0].pid
    answers = open_loop(
        stack, rate=12, seconds=8, faults=[(2.5, lambda: os.kill(old, signal.SIGKILL))]
    )
    deadline = time.monotonic() + 20
    while stack.nodes.procs[0].pid == old and time.monotonic() < deadline:
        time.sleep(0.1)
    # Only requests in flight on the killed node may be cut; everything else is answered.
    settle_and_check(stack, answers, {"cut"}, "kill -9 an engine node mid-stream", 2.5)
    cut = [a for a in answers if a.kind == "cut"]
    assert all(a.start < 2.5 for a in cut), cut


def test_nginx_reload_under_load(stack: Stack) -> None:
    master = pid_of(stack, "nginx")

    def reload() -> None:
        os.kill(master, signal.SIGHUP)

    answers = open_loop(stack, rate=12, seconds=7, faults=[(2.0, reload), (4.0, reload)])
    settle_and_check(stack, answers, set(), "nginx -s reload twice", 2.0)
    assert pid_of(stack, "nginx") == master


def test_corrupt_policy_mid_run(stack: Stack) -> None:
    path: Path = stack.runtime_policy
    good = path.read_bytes()

    def corrupt() -> None:
        path.write_bytes(b"\xff\xfe version: [unclosed\n" + good[:200])

    def restore() -> None:
        path.write_bytes(good)

    try:
        answers = open_loop(stack, rate=12, seconds=6, faults=[(1.5, corrupt), (4.0, restore)])
    finally:
        path.write_bytes(good)
    settle_and_check(stack, answers, set(), "policies.yaml corrupted then restored", 1.5)
    assert all(a.kind in ("ok", "refused") for a in answers)
    with urllib.request.urlopen(f"{stack.sidecar_url}/metrics", timeout=5) as m:
        text = m.read().decode()
    assert 'admission_policy_reloads_total{result="invalid"}' in text


def test_clients_abort_mid_stream(stack: Stack) -> None:
    answers = open_loop(stack, rate=12, seconds=6, faults=[], abort_frac=0.6)
    assert sum(a.kind == "aborted" for a in answers) >= 5
    settle_and_check(stack, answers, {"aborted"}, "clients abort mid-stream", 0.0)


@pytest.mark.parametrize(
    ("label", "on", "off"),
    [
        (
            "Redis OOM (maxmemory 1)",
            [["CONFIG", "SET", "maxmemory", "1"]],
            [["CONFIG", "SET", "maxmemory", "0"]],
        ),
        (
            "Redis READONLY (demoted to a replica)",
            [["REPLICAOF", "127.0.0.1", "1"]],
            [["REPLICAOF", "NO", "ONE"]],
        ),
    ],
)
def test_redis_refusing_writes(
    stack: Stack, label: str, on: list[list[str]], off: list[list[str]]
) -> None:
    def run(cmds: list[list[str]]) -> Callable[[], None]:
        def f() -> None:
            r = redis_client(stack)
            for c in cmds:
                r.execute_command(*c)
            r.close()

        return f

    errors = redis_errors(stack)
    try:
        answers = open_loop(stack, rate=12, seconds=7, faults=[(2.0, run(on)), (3.5, run(off))])
    finally:
        run(off)()
    settle_and_check(stack, answers, set(), label, 2.0)
    assert redis_errors(stack) > errors


# Slow readers (issue 28): 200 streams far larger than the socket buffers between the engine and a
# client (n 8 × 320 tokens with 20 alternatives each: ~4.5 MB, past the 4 MiB a send buffer
# grows to by default), each read a byte every two seconds by a client with a 4 KiB receive
# buffer, from the batch tenant; realtime streams from another tenant meanwhile.
SLOW_READERS = 200
SLOW_BODY = {
    "model": "llama-3-8b",
    "messages": [{"role": "user", "content": "list every token you know " * 4}],
    "max_tokens": 320,
    "ignore_eos": True,
    "n": 8,
    "logprobs": True,
    "top_logprobs": 20,
    "stream": True,
    "stream_options": {"include_usage": True},
}


async def slow_reader(port: int, release: asyncio.Event, statuses: list[bytes]) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    # limit: the reader stops taking bytes from the socket past 8 KiB unread.
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    data = json.dumps(SLOW_BODY).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-demo-etl\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data
    )
    statuses.append((await reader.readline())[9:12])
    while not release.is_set():
        await reader.read(1)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release.wait(), 2.0)
    writer.close()


async def realtime_ttft(s: aiohttp.ClientSession, url: str) -> float | None:
    """Seconds to the first generated token of a short realtime stream (None: not a 200)."""
    t = time.monotonic()
    body = {
        "model": "llama-3-8b",
        "messages": [{"role": "user", "content": "a quick answer please"}],
        "max_tokens": 24,
        "stream": True,
    }
    headers = {"Authorization": "Bearer sk-demo-acme"}
    async with s.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            return None
        ttft = None
        async for line in r.content:
            if ttft is None and b"tok" in line:
                ttft = time.monotonic() - t
        return ttft


def engines_idle(stack: Stack) -> bool:
    assert stack.nodes is not None
    for port in stack.nodes.ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as m:
            for ln in m.read().decode().splitlines():
                busy = ln.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
                if busy and float(ln.rsplit(" ", 1)[1]) > 0:
                    return False
    return True


def test_slow_readers_hold_nothing_and_realtime_keeps_its_ttft(stack: Stack) -> None:
    async def main() -> tuple[list[bytes], list[float | None], dict[str, Any], int]:
        release = asyncio.Event()
        statuses: list[bytes] = []
        readers = []
        ttfts: list[asyncio.Future[float | None]] = []
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s:
            t0 = time.monotonic()
            for i in range(SLOW_READERS):  # over the first 15 s
                await asyncio.sleep(max(0.0, t0 + i * 15 / SLOW_READERS - time.monotonic()))
                readers.append(asyncio.ensure_future(slow_reader(stack.port, release, statuses)))
                if i % 10 == 0:
                    ttfts.append(asyncio.ensure_future(realtime_ttft(s, stack.url)))
            while time.monotonic() - t0 < 30:  # realtime at 2/s for 20 s more
                await asyncio.sleep(0.5)
                ttfts.append(asyncio.ensure_future(realtime_ttft(s, stack.url)))
            answered = await asyncio.gather(*ttfts)
            # The engines finish the readers' work while the readers still hold their streams.
            loop = asyncio.get_running_loop()
            for _ in range(240):
                if await loop.run_in_executor(None, engines_idle, stack):
                    break
                await asyncio.sleep(0.5)
            assert stack.redis_url is not None
            left = await loop.run_in_executor(None, wait_unbooked, stack.redis_url, 15.0)
            connected = sum(not r.done() for r in readers)
            release.set()
            await asyncio.gather(*readers)
        return statuses, list(answered), left, connected

    statuses, ttfts, left, connected = asyncio.run(main())
    admitted = statuses.count(b"200")
    ok = sorted(t for t in ttfts if t is not None)
    within = sum(t <= 1.0 for t in ok) / max(1, len(ttfts))
    print(
        f"\nCHAOS {SLOW_READERS} slow readers: {Counter(statuses)}; {connected} still reading "
        f"when the engines were idle; booked then: {len(left)} keys; realtime {len(ttfts)} "
        f"streams, TTFT p50 {ok[len(ok) // 2]:.2f} s, p90 {ok[int(len(ok) * 0.9)]:.2f} s, "
        f"{within:.0%} within the 1 s target"
    )
    assert admitted >= SLOW_READERS // 2, Counter(statuses)
    assert connected == SLOW_READERS  # every reader was still on its stream…
    assert not left, left  # …and nothing was booked for any of them
    # ≥ 85 % of realtime streams within the 1 s target (measured 94–96 %): the readers' 0.9 GB
    # of answers pass through the same two cores as the engines, NGINX and this client.
    assert within >= 0.85, ok
    assert stack.redis_url is not None
    assert not wait_unbooked(stack.redis_url)
    health = sidecar_health(stack.sock_dir)
    assert len(health) == 2 and all(h == (200, "ok") for h in health), health
