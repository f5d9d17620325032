"""Benchmark: the emulator's calibration table, and the CPU cost of eight emulated nodes.

    .venv/bin/python -m loadtest.bench_emulator [--profile a100-40gb-llama3-8b] [--seconds 60]

(1) Calibration: the engine core (`engine.scheduler`, the same code the emulated node runs) in
    virtual time under Poisson arrivals of short chats (prompt ~U(20, 200) tokens, output
    ~U(30, 170)) at increasing rates: throughput (req/s, output tokens/s), TTFT p50/p99, KV usage
    and preemptions — beside the public figures the profile was calibrated to.
(2) Real time: eight emulated nodes as real processes (HTTP, metrics, SSE) on this machine,
    loaded open-loop at --node-rate req/s each for --cpu-seconds; prints their CPU share, so a
    benchmark can tell whether the emulator would be its bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request

import aiohttp

from devstack.procs import free_port, stop_process, wait_for
from engine.profiles import PROFILES
from engine.scheduler import Scheduler, Seq
from loadtest.benchmark.records import percentile

PUBLIC = {
    "a100-40gb-llama3-8b": "vendor article (ENGINE_FACTS.md): A100 40 GB, Llama-3-8B Q4, short chat, "
    "continuous batching ~55-65 req/s with P99 < 200 ms; FIFO without batching ~12-15 req/s",
    "h100-80gb-llama3-70b": "decode bound by weights/HBM: 70 GB fp8 over 2 x 3.35 TB/s ≈ 10 ms a step",
}


def simulate(profile: str, rate: float, seconds: float, seed: int = 1) -> dict[str, float]:
    p = PROFILES[profile]
    s = Scheduler(p)
    rng = random.Random(seed)
    t, next_arrival, done = 0.0, 0.0, []
    kv_max = 0.0
    while t < seconds or not s.idle():
        while next_arrival <= t and next_arrival < seconds:
            s.add(Seq(rng.randint(20, 200), rng.randint(30, 170), arrival=next_arrival))
            next_arrival += rng.expovariate(rate)
        if s.idle():
            t = next_arrival
            continue
        r = s.step(t)
        t += max(r.duration_s, 1e-4)
        kv_max = max(kv_max, s.kv_usage)
        done.extend(r.finished)
        if t > seconds * 4:
            break
    # Steady state only: skip the first 20% (warm-up); count what *finished* inside the window
    # (a backlog drained after arrivals stop is not throughput).
    lo, span = seconds * 0.2, seconds * 0.8
    finished = [q for q in done if q.finished_at is not None and lo <= q.finished_at < seconds]
    arrived = [q for q in done if lo <= q.arrival < seconds]
    ttft = [(q.first_token_at or 0) - q.arrival for q in arrived]
    return {
        "rate": rate,
        "rps": len(finished) / span,
        "tok_s": sum(q.generated for q in finished) / span,
        "ttft_p50": percentile(ttft, 50) * 1000,
        "ttft_p99": percentile(ttft, 99) * 1000,
        "kv_max": kv_max,
        "preempt": float(s.preemptions_total),
    }


async def drive(ports: list[int], rate: float, seconds: float) -> int:
    body = json.dumps({"model": None, "prompt": "x" * 800, "max_tokens": 100}).encode()
    ok = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4096)) as s:

        async def one(port: int) -> None:
            nonlocal ok
            async with s.post(
                f"http://127.0.0.1:{port}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as r:
                await r.read()
                ok += r.status == 200

        tasks = []
        start = time.perf_counter()
        n = int(rate * len(ports) * seconds)
        for i in range(n):
            due = start + i / (rate * len(ports))
            if (d := due - time.perf_counter()) > 0:
                await asyncio.sleep(d)
            tasks.append(asyncio.create_task(one(ports[i % len(ports)])))
        await asyncio.gather(*tasks)
    return ok


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in clock ticks


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--profile", default="a100-40gb-llama3-8b")
    ap.add_argument("--seconds", type=float, default=60, help="virtual seconds per rate")
    ap.add_argument("--rates", default="10,30,50,70,90,110,130")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--node-rate", type=float, default=20)
    ap.add_argument("--cpu-seconds", type=float, default=10)
    a = ap.parse_args()
    p = PROFILES[a.profile]
    print(
        f"profile {p.name}: KV pool {p.kv_pool_bytes / 2**30:.1f} GiB = {p.num_blocks * p.block_size:,} tokens, "
        f"max_num_seqs {p.max_num_seqs}, max_num_batched_tokens {p.max_num_batched_tokens}"
    )
    print(f"public figure: {PUBLIC.get(a.profile, 'none')}\n")
    print(
        "| offered req/s | served req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | peak KV | preemptions |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rate in [float(x) for x in a.rates.split(",")]:
        r = simulate(a.profile, rate, a.seconds)
        print(
            f"| {rate:.0f} | {r['rps']:.1f} | {r['tok_s']:,.0f} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | "
            f"{r['kv_max']:.0%} | {r['preempt']:.0f} |"
        )
    if a.nodes <= 0:
        return
    ports = [free_port() for _ in range(a.nodes)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "engine", "--port", str(pt), "--profile", a.profile],
            start_new_session=True,
        )
        for pt in ports
    ]
    try:
        for pt in ports:
            wait_for(
                lambda pt=pt: urllib.request.urlopen(f"http://127.0.0.1:{pt}/health").status == 200,
                30,
                "node",
            )
        before = [cpu_seconds(pr.pid) for pr in procs]
        t0 = time.perf_counter()
        ok = asyncio.run(drive(ports, a.node_rate, a.cpu_seconds))
        wall = time.perf_counter() - t0
        used = sum(cpu_seconds(pr.pid) - b for pr, b in zip(procs, before, strict=True))
        print(
            f"\n{a.nodes} emulated nodes in real time, {a.node_rate:.0f} req/s each ({a.nodes * a.node_rate:.0f} req/s, "
            f"100 output tokens each) for {wall:.1f}s: {ok} answered; emulator CPU {used:.2f} s = "
            f"{used / wall:.0%} of one core ({used / wall / 2:.0%} of this 2-core machine)"
        )
    finally:
        for pr in procs:
            stop_process(pr)


if __name__ == "__main__":
    main()
