"""Benchmark: does a 1,000-line OpenAI batch leave realtime alone, and survive kills?

Realtime chats (acme, globex, hobbyist) at `--load` × the cluster's capacity through the full
stack for `--seconds`, twice: alone, and with a `--lines`-line batch (nightly-etl, its offline
class) submitted at the start — in that run the batch worker, a sidecar and redis-server (AOF)
are killed with SIGKILL mid-run (`--kills`). Reported: realtime TTFT-target attainment and TTFT
p50/p99 in both runs, and for the batch: lines answered, duplicates, time to finish.

    python -m loadtest.bench_batch --nodes 2 --seconds 60 --lines 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai

from admission.policy import load_policy
from devstack.stack import DEFAULT_POLICY, Stack
from loadtest.benchmark import report
from loadtest.benchmark.capacity import capacity
from loadtest.benchmark.driver import drive
from loadtest.benchmark.scratch import add_flag, scratch
from loadtest.workloads.mix import Kind, schedule

KEYS = {
    "acme": "sk-demo-acme",
    "globex": "sk-demo-globex",
    "hobbyist": "sk-demo-hobbyist",
    "nightly-etl": "sk-demo-etl",
}
CHAT = Kind("chat", "realtime", ("acme", "globex"), 1.0, (50, 400), (30, 150))


def batch_file(n: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "llama-3-8b",
                    "max_tokens": 64,
                    "messages": [{"role": "user", "content": "summarise " * 200}],
                },
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


def run(name: str, a: argparse.Namespace, reqs: list[Any], work: Path) -> dict[str, Any]:
    stack = Stack(
        DEFAULT_POLICY,
        work / name,
        nodes=a.nodes,
        sidecars=2,
        batch_claim_idle_s=5,
        batch_concurrency=a.concurrency,
    )
    out: dict[str, Any] = {}
    with stack.running():
        c = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEYS["nightly-etl"], max_retries=3)
        bid, t0 = None, time.monotonic()
        if name == "with-batch":
            f = c.files.create(file=("in.jsonl", batch_file(a.lines)), purpose="batch")
            bid = c.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id

            def kills() -> None:
                for i, proc in enumerate(a.kills.split(",") if a.kills else []):
                    time.sleep(a.seconds / (len(a.kills.split(",")) + 1))
                    os.kill(dict(stack.procs)[proc].pid, signal.SIGKILL)
                    print(f"  killed {proc} (kill {i + 1})", flush=True)

            threading.Thread(target=kills, daemon=True).start()
        res = asyncio.run(
            drive(
                f"{stack.url}/v1/chat/completions",
                reqs,
                KEYS,
                None,
                name,
                "llama-3-8b",
                stack.node_ports,
                None,
            )
        )
        out["realtime"] = res
        if bid is not None:
            while True:
                try:
                    b = c.batches.retrieve(bid)
                except openai.APIError:
                    time.sleep(1)
                    continue
                if b.status in ("completed", "failed", "cancelled", "expired"):
                    break
                time.sleep(1)
            lines = []
            for fid in (b.output_file_id, b.error_file_id):
                if fid:
                    lines += [json.loads(x) for x in c.files.content(fid).text.splitlines()]
            ids = [x["custom_id"] for x in lines]
            out["batch"] = {
                "status": b.status,
                "answered": len(ids),
                "distinct": len(set(ids)),
                "ok": sum(1 for x in lines if x["error"] is None),
                "seconds": time.monotonic() - t0,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--load", type=float, default=0.6, help="realtime, × the cluster's capacity")
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--kills", default="batch-worker-0,sidecar-1,redis")
    ap.add_argument(
        "--concurrency", type=int, default=16, help="the batch worker's lines in flight"
    )
    add_flag(ap)
    a = ap.parse_args(argv)
    logging.getLogger("admission.policy").setLevel(logging.ERROR)
    rate = capacity("a100-40gb-llama3-8b", kinds=(CHAT,)) * a.nodes * a.load
    reqs = schedule(rate, a.seconds, seed=3, kinds=(CHAT,))
    target = (
        next(c.slo_ttft_ms for c in load_policy(DEFAULT_POLICY).classes.values() if c.slo_ttft_ms)
        / 1000
    )
    print(
        f"realtime {rate:.1f} chats/s ({a.load}× {a.nodes} nodes) for {a.seconds:.0f} s; "
        f"batch {a.lines} lines; kills: {a.kills or 'none'}",
        flush=True,
    )
    work = scratch("bench-batch-", a.keep_work)
    rows = {}
    for name in ("alone", "with-batch"):
        print(f"running {name} ...", flush=True)
        rows[name] = run(name, a, reqs, work)
    print(
        "\n| run | realtime sent | TTFT ≤ target | TTFT p50 / p99 ms | generator late p99 ms | lost "
        "| batch |\n|---|---:|---:|---|---:|---:|---|"
    )
    for name, r in rows.items():
        recs = r["realtime"].records
        ttft = [x.ttft_s * 1000 for x in recs if x.ok and x.ttft_s is not None]
        b = r.get("batch")
        bcol = (
            (
                f"{b['status']}: {b['answered']} answered ({b['distinct']} distinct), {b['ok']} ok, "
                f"{b['seconds']:.0f} s"
            )
            if b
            else "—"
        )
        print(
            f"| {name} | {len(recs)} | {report.attainment(recs, target) * 100:.1f} % | "
            f"{report.percentile(ttft, 50):.0f} / {report.percentile(ttft, 99):.0f} | "
            f"{report.percentile([x.late_s * 1000 for x in recs], 99):.0f} | "
            f"{sum(1 for x in recs if x.lost)} | {bcol} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
