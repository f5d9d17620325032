"""Benchmark: admissions per second and /admit latency for ONE sidecar process against Redis.

    .venv/bin/python -m loadtest.bench_admit [--seconds 10] [--rate 1000] [--concurrency 64]

Starts its own redis-server and `admission serve` on a unix socket (loopback only), publishes
an open node state as an agent would, then (1) closed loop: `--concurrency` clients admit and
release as fast as they can → admissions/s; (2) open loop at `--rate` admissions/s → /admit
latency p50/p99 (each admission is followed by its release, as NGINX would send it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import subprocess
import time

import aiohttp
import redis

from admission.nodes.state import NodeState, Status
from admission.store import keys
from devstack.procs import RedisServer, sidecar_command, stop_process, wait_for
from loadtest.benchmark.records import percentile
from loadtest.benchmark.scratch import add_flag, scratch

POLICY = """
redis: {{url: "{url}", pool_size: 64}}
queue: {{max_depth: 100000, max_depth_per_tenant: 100000}}
classes: {{realtime: {{weight: 1, priority: 0, deadline_s: 10}}}}
tenants:
{tenants}
nodes:
  n1: {{url: "http://127.0.0.1:9", models: [m], memory_source: kv, max_inflight: 100000}}
"""
TENANT = '  t{i}: {{keys: ["sha256:{d}"], limits: {{requests_per_s: 100000, request_burst: 100000, tokens_per_min: 1000000000, token_burst: 100000000}}}}'


async def one(
    session: aiohttp.ClientSession, i: int, lat: list[float] | None, release: bool = True
) -> bool:
    body = {"tenant": f"t{i % 16}", "model": "m", "prompt_tokens": 50, "max_tokens": 100}
    t0 = time.perf_counter()
    async with session.post("http://sidecar/admit", json=body) as r:
        data = await r.json()
    if lat is not None:
        lat.append(time.perf_counter() - t0)
    if r.status != 200:
        return False
    if not release:
        return True
    usage = {"prompt_tokens": 50, "completion_tokens": 60}
    async with session.post(
        "http://sidecar/release", json={"ticket": data["ticket"], "status": 200, "usage": usage}
    ) as r2:
        await r2.read()
    return True


async def closed_loop(
    sock: str, seconds: float, concurrency: int, release: bool = True
) -> tuple[int, int]:
    ok = fail = 0
    deadline = time.monotonic() + seconds
    conn = aiohttp.UnixConnector(path=sock, limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def worker(w: int) -> None:
            nonlocal ok, fail
            i = w
            while time.monotonic() < deadline:
                if await one(s, i, None, release):
                    ok += 1
                else:
                    fail += 1
                i += concurrency

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return ok, fail


async def open_loop(sock: str, seconds: float, rate: float) -> tuple[list[float], float]:
    lat: list[float] = []
    conn = aiohttp.UnixConnector(path=sock, limit=512)
    late: list[float] = []
    async with aiohttp.ClientSession(connector=conn) as s:
        tasks = []
        start = time.perf_counter()
        n = int(seconds * rate)
        for i in range(n):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            late.append(time.perf_counter() - due)
            tasks.append(asyncio.create_task(one(s, i, lat)))
        await asyncio.gather(*tasks)
    return lat, statistics.mean(late)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--rate", type=float, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    add_flag(ap)
    a = ap.parse_args()
    work = scratch("bench-admit-", a.keep_work)
    rs = RedisServer(work / "redis")
    rs.start()
    policy = work / "policies.yaml"
    policy.write_text(
        POLICY.format(
            url=rs.url,
            tenants="\n".join(
                TENANT.format(i=i, d=hashlib.sha256(f"k{i}".encode()).hexdigest())
                for i in range(16)
            ),
        )
    )
    sock = str(work / "sidecar.sock")
    proc = subprocess.Popen(
        sidecar_command(str(policy), sock),
        start_new_session=True,
    )
    r = redis.Redis.from_url(rs.url)
    try:
        state = NodeState(
            node="n1", seq=1, state=Status.OPEN, source="kv", healthy=True, memory=0.1
        )
        r.set(keys.node_state("n1"), state.to_json(), px=600_000)
        wait_for(lambda: os.path.exists(sock), 20, "sidecar")
        time.sleep(0.5)
        ok, fail = asyncio.run(closed_loop(sock, a.seconds, a.concurrency, release=False))
        print(
            f"closed loop, {a.concurrency} clients, {a.seconds:.0f}s: {ok / a.seconds:,.0f} admissions/s "
            f"(/admit only), {fail} refused"
        )
        ok, fail = asyncio.run(closed_loop(sock, a.seconds, a.concurrency))
        print(
            f"closed loop, {a.concurrency} clients, {a.seconds:.0f}s: {ok / a.seconds:,.0f} admissions/s "
            f"(each followed by its /release, as NGINX sends it), {fail} refused"
        )
        lat, late = asyncio.run(open_loop(sock, a.seconds, a.rate))
        ms = [x * 1000 for x in lat]
        print(
            f"open loop at {a.rate:,.0f}/s for {a.seconds:.0f}s: /admit latency p50 {percentile(ms, 50):.2f} ms, "
            f"p99 {percentile(ms, 99):.2f} ms, max {max(ms):.2f} ms (n={len(ms)}, mean send lateness {late * 1000:.2f} ms)"
        )
    finally:
        stop_process(proc)
        rs.stop()
        r.close()


if __name__ == "__main__":
    main()
