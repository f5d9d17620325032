"""Benchmark: does a tenant that owns a node keep its share while another tenant floods?

Two tenants of the same tier send realtime chats through the full stack (NGINX + ngx_lua, two
sidecars, Redis, the agent) to N emulated A100 nodes: `vip` offers `--vip-load` of ONE node's
capacity (the baseline it bought), `flood` offers `--flood-load` × the whole cluster's. Runs:

- `shared`: no pools: both tenants compete in the weighted-fair queue (equal weights);
- `pool`: node-0 is vip's pool (`lend: true`): vip's requests go there first, its idle capacity
  serves flood while no vip request waits.

Per tenant: requests answered, TTFT p50/p95/p99, TTFT-target attainment (the realtime class's
`slo.ttft_ms`, refused requests counted as misses) and output tokens/s over the real makespan.

    python -m loadtest.bench_pools --nodes 4 --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from admission.policy import load_policy
from devstack.nodes import NodeSet
from devstack.stack import DEFAULT_POLICY, Stack
from engine.profiles import PROFILES
from loadtest.benchmark import report
from loadtest.benchmark.capacity import capacity
from loadtest.benchmark.driver import drive
from loadtest.benchmark.scratch import add_flag, scratch
from loadtest.workloads.mix import Kind, schedule

CHAT = (50, 400), (30, 150)  # prompt and output tokens, as the mixed benchmark's chats


def tenants(limits: dict[str, Any]) -> dict[str, Any]:
    return {
        t: {
            "tier": "gold",
            "keys": [f"plain:sk-bench-{t}"],
            "classes": ["realtime"],
            "limits": limits,
        }
        for t in ("vip", "flood")
    }


def run(name: str, a: argparse.Namespace, reqs: list[Any], work: Path) -> report.SystemResult:
    run_dir = work / name
    run_dir.mkdir(parents=True)
    nodes = NodeSet(a.nodes, run_dir, profile=a.profile)
    entries = nodes.policy_nodes(max_inflight=a.max_inflight)
    limits = {
        "requests_per_s": 10000,
        "request_burst": 10000,
        "tokens_per_min": 10**9,
        "token_burst": 10**6,
        "max_concurrent": 100000,
        "max_queued": 100000,
    }
    overrides: dict[str, Any] = {"tenants": tenants(limits)}
    if name == "pool":
        entries["node-0"]["pool"] = "vip-pool"
        overrides["pools"] = {"vip-pool": {"tenants": ["vip"], "lend": True, "spill": True}}
    stack = Stack(DEFAULT_POLICY, run_dir, external_nodes=entries, policy_overrides=overrides)
    try:
        stack.start()
        keys = {t: f"sk-bench-{t}" for t in ("vip", "flood")}
        return asyncio.run(
            drive(
                f"{stack.url}/v1/chat/completions",
                reqs,
                keys,
                None,
                name,
                PROFILES[a.profile].model,
                nodes.ports,
                f"{stack.sidecar_url}/healthz",
            )
        )
    finally:
        stack.stop()
        nodes.stop()


def per_tenant(res: report.SystemResult, target_s: float) -> dict[str, dict[str, float]]:
    out = {}
    for t in ("vip", "flood"):
        rs = [r for r in res.records if r.tenant == t]
        ttft = [r.ttft_s * 1000 for r in rs if r.ok and r.ttft_s is not None]
        out[t] = {
            "sent": len(rs),
            "ok": sum(1 for r in rs if r.ok),
            "ttft_p50_ms": report.percentile(ttft, 50),
            "ttft_p95_ms": report.percentile(ttft, 95),
            "ttft_p99_ms": report.percentile(ttft, 99),
            "attainment": report.attainment(rs, target_s),
            "tokens_per_s": sum(r.completion_tokens for r in rs if r.ok) / res.seconds,
            "lost": sum(1 for r in rs if r.lost),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--vip-load", type=float, default=0.8, help="× one node's capacity")
    ap.add_argument("--flood-load", type=float, default=2.0, help="× the cluster's capacity")
    ap.add_argument("--profile", default="a100-40gb-llama3-8b")
    ap.add_argument("--max-inflight", type=int, default=256)
    ap.add_argument("--runs", default="shared,pool")
    ap.add_argument("--seed", type=int, default=7)
    add_flag(ap)
    a = ap.parse_args(argv)
    logging.getLogger("admission.policy").setLevel(logging.ERROR)
    vip_kind = Kind("chat", "realtime", ("vip",), 1.0, *CHAT)
    flood_kind = Kind("chat", "realtime", ("flood",), 1.0, *CHAT)
    node_cap = capacity(a.profile, kinds=(vip_kind,))
    vip_rate, flood_rate = node_cap * a.vip_load, node_cap * a.nodes * a.flood_load
    reqs = sorted(
        schedule(vip_rate, a.seconds, seed=a.seed, kinds=(vip_kind,))
        + schedule(flood_rate, a.seconds, seed=a.seed + 1, kinds=(flood_kind,)),
        key=lambda r: r.at_s,
    )
    target_s = (
        next(c.slo_ttft_ms for c in load_policy(DEFAULT_POLICY).classes.values() if c.slo_ttft_ms)
        / 1000
    )
    print(
        f"one node: {node_cap:.1f} chats/s; vip offers {vip_rate:.1f}/s ({a.vip_load}× a node), "
        f"flood {flood_rate:.1f}/s ({a.flood_load}× {a.nodes} nodes) for {a.seconds:.0f} s; "
        f"TTFT target {target_s * 1000:.0f} ms",
        flush=True,
    )
    work = scratch("bench-pools-", a.keep_work)
    rows = []
    for name in a.runs.split(","):
        res = run(name, a, reqs, work)
        for t, m in per_tenant(res, target_s).items():
            rows.append((name, t, m))
    print(
        "\n| run | tenant | sent | answered | TTFT p50 / p95 / p99 ms | TTFT ≤ target | "
        "output tok/s | lost |\n|---|---|---:|---:|---|---:|---:|---:|"
    )
    for name, t, m in rows:
        print(
            f"| {name} | {t} | {m['sent']} | {m['ok']} | {m['ttft_p50_ms']:.0f} / "
            f"{m['ttft_p95_ms']:.0f} / {m['ttft_p99_ms']:.0f} | {m['attainment'] * 100:.1f} % | "
            f"{m['tokens_per_s']:.0f} | {m['lost']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
