"""Benchmark: latency the admission path adds at the edge, both paths in one run.

    .venv/bin/python -m loadtest.bench_edge [--rate 500] [--seconds 20] [--delay-ms 20] [--stub nginx]

One fixed-latency stub node (loadtest/benchmark/stub.py, --delay-ms). One NGINX with two servers: a plain
proxy straight to the stub, and the full admission edge (Lua identify → sidecar over a unix
socket → Redis token buckets and node lease → proxy → release). The same chat request is sent
open-loop at --rate per second to EACH path, interleaved, and p50/p99 of both and their
differences are printed. Send lateness of the generator is reported so a late generator is seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

import aiohttp

from devstack.procs import free_port, http_ok, stop_process, wait_for
from loadtest.benchmark.records import percentile
from loadtest.benchmark.scratch import add_flag, scratch
from loadtest.benchmark.stub import beside_plain_nginx, nginx_stub


async def load(
    urls: dict[str, str], rate: float, seconds: float, body: bytes
) -> tuple[dict[str, list[float]], list[float], dict[str, int]]:
    lat: dict[str, list[float]] = {k: [] for k in urls}
    errors = dict.fromkeys(urls, 0)
    late: list[float] = []
    headers = {"Authorization": "Bearer sk-demo-acme", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024)) as s:

        async def one(name: str) -> None:
            t0 = time.perf_counter()
            async with s.post(urls[name], data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    errors[name] += 1
                    return
            lat[name].append((time.perf_counter() - t0) * 1000)

        tasks = []
        names = list(urls)
        start = time.perf_counter()
        n = int(rate * seconds) * len(names)
        for i in range(n):
            due = start + i / (rate * len(names))
            if (d := due - time.perf_counter()) > 0:
                await asyncio.sleep(d)
            late.append((time.perf_counter() - due) * 1000)
            tasks.append(asyncio.create_task(one(names[i % len(names)])))
        await asyncio.gather(*tasks)
    return lat, late, errors


def histograms(sidecar_url: str) -> dict[str, tuple[float, float, dict[float, float]]]:
    """The sidecar's histograms so far, by name: count, sum, cumulative buckets."""
    with urllib.request.urlopen(f"{sidecar_url}/metrics", timeout=5) as r:
        return histograms_in(r.read().decode())


def histograms_in(text: str) -> dict[str, tuple[float, float, dict[float, float]]]:
    """`histograms` of a metrics page's text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, tuple[float, float, dict[float, float]]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type != "histogram":
            continue
        count = total = 0.0
        buckets: dict[float, float] = {}
        for smp in fam.samples:  # summed over labels
            if smp.name.endswith("_count"):
                count += smp.value
            elif smp.name.endswith("_sum"):
                total += smp.value
            elif smp.name.endswith("_bucket"):
                le = float(smp.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + smp.value
        out[fam.name] = (count, total, buckets)
    return out


def samples(sidecar_url: str) -> dict[tuple[str, str], float]:
    """The sidecar's counters so far: (name, first label value) → value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{sidecar_url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, next(iter(s.labels.values()), "")): s.value
        for fam in text_string_to_metric_families(text)
        if fam.type == "counter"
        for s in fam.samples
        if s.name.endswith("_total")
    }


def counters(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float], prefix: str
) -> str:
    """What a labelled counter counted between two reads, by label."""
    parts = [
        f"{label} {v - before.get((name, label), 0.0):,.0f}"
        for (name, label), v in sorted(after.items())
        if name.startswith(prefix)
    ]
    return ", ".join(parts) or "none"


def redis_calls(redis_url: str) -> dict[str, tuple[int, float]]:
    """Redis's own count of calls and CPU microseconds per command so far (INFO commandstats)."""
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        stats = r.info("commandstats")
    finally:
        r.close()
    return {
        k.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"])) for k, v in stats.items()
    }


def redis_cpu(before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]]) -> str:
    """Calls and CPU per call inside Redis for each command that ran between two reads."""
    parts = []
    for cmd, (c1, u1) in sorted(after.items(), key=lambda kv: -kv[1][1]):
        c0, u0 = before.get(cmd, (0, 0.0))
        if c1 > c0 and cmd != "info":
            parts.append(f"{cmd} {c1 - c0:,} × {(u1 - u0) / (c1 - c0):.0f} µs")
    return ", ".join(parts) or "none"


def inside(before: dict[str, Any], after: dict[str, Any], name: str) -> str:
    """Mean and shares under 0.5 / 1 / 2 ms of one histogram between two reads."""
    (c0, s0, b0), (c1, s1, b1) = before[name], after[name]
    n = c1 - c0
    if n <= 0:
        return "none"
    shares = ", ".join(
        f"≤ {le * 1000:g} ms {(b1[le] - b0.get(le, 0.0)) / n:.1%}"
        for le in (0.0005, 0.001, 0.002)
        if le in b1
    )
    return f"mean {(s1 - s0) / n * 1000:.2f} ms over {n:,.0f} ({shares})"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rate", type=float, default=500, help="requests/s on each path")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--delay-ms", type=float, default=20)
    ap.add_argument(
        "--stub",
        choices=("python", "nginx"),
        default="python",
        help="the node stub: aiohttp (~150 µs of CPU per answer on the same cores) or "
        "NGINX + Lua (~15 µs; a real node is another machine)",
    )
    ap.add_argument(
        "--wait-for-redis",
        action="store_true",
        help="redis.answer_ahead: false (every answer waits for its Redis round trip)",
    )
    add_flag(ap)
    a = ap.parse_args()
    stub_port, direct_port = free_port(), free_port()
    work = scratch("bench-edge-", a.keep_work)
    if a.stub == "nginx":
        stub = nginx_stub(work / "stub", stub_port, a.delay_ms)
    else:
        stub = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loadtest.benchmark.stub",
                "--port",
                str(stub_port),
                "--delay-ms",
                str(a.delay_ms),
            ],
            start_new_session=True,
        )
        wait_for(lambda: http_ok(f"http://127.0.0.1:{stub_port}/health"), 20, "stub", stub)
    stack = beside_plain_nginx(stub_port, direct_port, work / "stack", 1, not a.wait_for_redis)
    try:
        stack.start()
        body = json.dumps(
            {"model": "stub", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
        ).encode()
        urls = {
            "nginx direct": f"http://127.0.0.1:{direct_port}/v1/chat/completions",
            "nginx + admission": f"{stack.url}/v1/chat/completions",
        }
        asyncio.run(load(urls, 50, 2, body))  # warm-up: connections, caches, JIT of Lua
        os.sched_setaffinity(0, os.sched_getaffinity(0))
        before, rbefore = histograms(stack.sidecar_url), redis_calls(stack.redis_url or "")
        before_c = samples(stack.sidecar_url)
        lat, late, errors = asyncio.run(load(urls, a.rate, a.seconds, body))
        after, rafter = histograms(stack.sidecar_url), redis_calls(stack.redis_url or "")
        after_c = samples(stack.sidecar_url)
        print(
            f"{a.rate:.0f} req/s on each path for {a.seconds:.0f}s, stub latency {a.delay_ms:.0f} ms "
            f"(generator lateness p50 {percentile(late, 50):.2f} ms, p99 {percentile(late, 99):.2f} ms)"
        )
        print(f"{'path':<20} {'n':>6} {'err':>4} {'p50 ms':>8} {'p99 ms':>8}")
        for k, v in lat.items():
            print(
                f"{k:<20} {len(v):>6} {errors[k]:>4} {percentile(v, 50):>8.2f} {percentile(v, 99):>8.2f}"
            )
        d, f = lat["nginx direct"], lat["nginx + admission"]
        print(
            f"{'added by admission':<20} {'':>6} {'':>4} {percentile(f, 50) - percentile(d, 50):>8.2f} {percentile(f, 99) - percentile(d, 99):>8.2f}"
        )
        # Of what is added, the part spent inside the sidecar (ask read → answer written), and
        # of that its Redis round trips; the rest is the hops (NGINX ↔ sidecar, each process's
        # wake-up) and NGINX's Lua.
        print(
            "inside the sidecar, per decision: "
            + inside(before, after, "admission_decision_seconds")
        )
        print(
            "of which Redis, per round trip:  "
            + inside(before, after, "admission_redis_round_trip_seconds")
        )
        print("answered ahead of Redis:          " + counters(before_c, after_c, "admission_ahead"))
        # Redis's own CPU per command (a script call's time inside Redis, without the hop).
        print("inside Redis, CPU per call:       " + redis_cpu(rbefore, rafter))
    finally:
        stack.stop()
        stop_process(stub)


if __name__ == "__main__":
    main()
