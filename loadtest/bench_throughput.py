"""Benchmark: the most requests per second through the full edge, next to plain NGINX.

    python -m loadtest.bench_throughput [--seconds 30] [--clients 64,256,1024] [--delay-ms 20]

One stub node that answers every chat after `--delay-ms` (an NGINX with ngx_lua, so that the
stub is not what saturates), one edge NGINX with two servers — a plain proxy straight to the
stub, and the full admission edge (Lua identify → one of two sidecars over a unix socket →
Redis buckets and node lease → proxy → batched release) — and `wrk` as the closed-loop client:
`--clients` connections, each sending its next request when the last is answered. Both paths
take turns in the same run, on the same two cores. Also measured: the stack at idle and at
~20 req/s. For every step: requests/s, p50/p99 latency, answers by kind (any
`admission_unavailable` while every sidecar is alive is a failure of the edge), and the CPU each
process used — in cores and in µs per request — read from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from devstack.procs import free_port, stop_process
from devstack.stack import Stack
from loadtest.benchmark.scratch import add_flag, keep, scratch
from loadtest.benchmark.stub import beside_plain_nginx, nginx_stub

TICK = os.sysconf("SC_CLK_TCK")
BODY = json.dumps(
    {"model": "stub", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
)
# wrk: POST the chat with the demo key; count answers by status and, for refusals, by code.
WRK_LUA = """wrk.method = "POST"
wrk.body = [[{body}]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-demo-acme"
counts = {{}}
local gap = {gap}
function delay() return gap end
function response(status, headers, body)
  local k = tostring(status)
  if status ~= 200 then k = k .. ":" .. (string.match(body or "", '"code":%s*"([^"]*)"') or "-") end
  counts[k] = (counts[k] or 0) + 1
end
function setup(thread) table.insert(threads, thread) end
threads = {{}}
function done(summary, latency, requests)
  local all = {{}}
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("counts")) do all[k] = (all[k] or 0) + v end
  end
  local parts = {{}}
  for k, v in pairs(all) do table.insert(parts, string.format('"%s":%d', k, v)) end
  io.write("ANSWERS {{" .. table.concat(parts, ",") .. "}}\\n")
  io.write(string.format("LATENCY %.3f %.3f\\n", latency:percentile(50) / 1000,
                         latency:percentile(99) / 1000))
end
"""


@dataclass
class Step:
    rps: float
    n: int
    p50: float
    p99: float
    answers: dict[str, int]
    cores: dict[str, float]  # by process role
    us_per_req: dict[str, float]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def groups(stack: Stack, stub: subprocess.Popen[bytes]) -> dict[str, list[int]]:
    """The processes to account, by role (NGINX: master and workers)."""
    procs = dict(stack.procs)
    out: dict[str, list[int]] = {}
    for name, p in procs.items():
        role = re.sub(r"-\d+$", "", name)
        pids = [p.pid] + (children(p.pid) if name == "nginx" else [])
        out.setdefault("edge nginx" if name == "nginx" else role, []).extend(pids)
    out["stub nginx"] = [stub.pid, *children(stub.pid)]
    return out


def measure(
    url: str,
    clients: int,
    seconds: float,
    script: Path,
    roles: dict[str, list[int]],
    threads: int = 2,
) -> Step:
    before = {r: sum(cpu_s(p) for p in ps) for r, ps in roles.items()}
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk, once it has been waited for
    before["wrk (client)"] = ru.ru_utime + ru.ru_stime
    t0 = time.monotonic()
    wrk = subprocess.run(
        [
            "wrk",
            "-t",
            str(min(threads, clients)),
            "-c",
            str(clients),
            "-d",
            f"{seconds:g}s",
            "--timeout",
            "30s",
            "-s",
            str(script),
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.monotonic() - t0
    cpu = {r: sum(cpu_s(p) for p in ps) - before[r] for r, ps in roles.items()}
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu["wrk (client)"] = ru.ru_utime + ru.ru_stime - before["wrk (client)"]
    out = wrk.stdout
    got = re.search(r"ANSWERS (\{.*\})", out)
    lat = re.search(r"LATENCY (\S+) (\S+)", out)
    if got is None or lat is None:
        raise RuntimeError(f"wrk printed no summary: {out[-500:]} {wrk.stderr[-500:]}")
    answers: dict[str, int] = json.loads(got.group(1))
    n = sum(answers.values())
    return Step(
        n / wall,
        n,
        float(lat.group(1)),
        float(lat.group(2)),
        answers,
        {r: c / wall for r, c in cpu.items()},
        {r: c / n * 1e6 if n else 0.0 for r, c in cpu.items()},
    )


def fmt_answers(a: dict[str, int]) -> str:
    return ", ".join(f"{v:,} × {k}" for k, v in sorted(a.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--clients", default="64,256,1024")
    ap.add_argument("--delay-ms", type=float, default=20)
    ap.add_argument("--sidecars", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=10, help="the idle measurement's length")
    add_flag(ap)
    a = ap.parse_args(argv)
    if shutil.which("wrk") is None:
        print("bench_throughput needs wrk (scripts/setup.sh installs it)")
        return 2
    work = scratch("bench-throughput-", a.keep_work)
    stub_port, direct_port = free_port(), free_port()
    stub = nginx_stub(work, stub_port, a.delay_ms)
    stack = beside_plain_nginx(stub_port, direct_port, work / "stack", a.sidecars)
    closed = work / "closed.lua"
    closed.write_text(WRK_LUA.format(body=BODY, gap=0))
    paced = work / "paced.lua"  # 2 connections, each waiting 80 ms after an answer: ~20 req/s
    paced.write_text(WRK_LUA.format(body=BODY, gap=80))
    try:
        stack.start()  # picks the edge's port: `url` is read after it
        paths = {
            "plain NGINX": f"http://127.0.0.1:{direct_port}/v1/chat/completions",
            "full edge": f"{stack.url}/v1/chat/completions",
        }
        roles = groups(stack, stub)
        for url in paths.values():  # warm-up: connections, Lua code cache, sidecar caches
            measure(url, 32, 2, closed, roles)
        rows: list[tuple[str, str, Step]] = []
        before = {r: sum(cpu_s(p) for p in ps) for r, ps in roles.items()}
        time.sleep(a.idle_s)
        idle = {r: sum(cpu_s(p) for p in ps) - before[r] for r, ps in roles.items()}
        print(
            f"idle ({a.idle_s:g} s, no requests), cores: "
            + ", ".join(f"{r} {c / a.idle_s:.3f}" for r, c in idle.items()),
            flush=True,
        )
        for name, url in paths.items():
            rows.append((name, "~20 req/s", measure(url, 2, min(a.seconds, 15), paced, roles, 1)))
        for c in (int(x) for x in a.clients.split(",")):
            for name, url in paths.items():
                rows.append((name, f"{c} clients", measure(url, c, a.seconds, closed, roles)))
                print(f"  {name}, {c} clients: {rows[-1][2].rps:,.0f} req/s", flush=True)
        report(rows)
        bad = sum(r.answers.get("503:admission_unavailable", 0) for _n, _s, r in rows)
        if bad:
            keep(work)  # the logs of every process: why the edge said it was unavailable
        return 1 if bad else 0
    finally:
        stack.stop()
        stop_process(stub)


def report(rows: list[tuple[str, str, Step]]) -> None:
    print(
        "\n| path | load | req/s | ratio to plain | p50 / p99 ms | answers |\n"
        "|---|---|---:|---:|---|---|"
    )
    plain = {s: r.rps for n, s, r in rows if n == "plain NGINX"}
    for name, step, r in rows:
        ratio = r.rps / plain[step] if plain.get(step) else 0.0
        print(
            f"| {name} | {step} | {r.rps:,.0f} | {ratio:.2f} | {r.p50:.2f} / {r.p99:.2f} "
            f"| {fmt_answers(r.answers)} |"
        )
    roles = list(rows[0][2].cores)
    print("\nCPU per request (µs) by process; cores in use in brackets\n")
    print("| path | load | " + " | ".join(roles) + " |\n|---|---|" + "---:|" * len(roles))
    for name, step, r in rows:
        cells = " | ".join(f"{r.us_per_req[k]:.0f} ({r.cores[k]:.2f})" for k in roles)
        print(f"| {name} | {step} | {cells} |")


if __name__ == "__main__":
    raise SystemExit(main())
