"""The demand signal driving the cluster's size (issue 65): emulated nodes, a 2× overload of the
nodes listed in the policy, and a small controller that reads the sidecar's demand signal
(`/status.json` "demand": nodes needed against nodes serving) every 2 s, starts
`admission agent --register` for a spare node when more are needed, and sends SIGTERM to a
registered one (a graceful leave) when fewer are. Printed, window by window: each class's
share served within its first-token target, the refusals, the nodes serving; and what was
lost. `--no-scale`: the same load on the listed nodes alone, for comparison.

    python -m loadtest.bench_autoscale [--start-nodes 2] [--spare 3] [--load 2.0] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from admission.policy import load_policy
from devstack.nodes import NodeSet, node_entry
from devstack.procs import stop_process
from devstack.stack import Stack
from engine.profiles import PROFILES
from loadtest.bench import BENCH_POLICY
from loadtest.benchmark.capacity import capacity
from loadtest.benchmark.driver import drive
from loadtest.benchmark.records import Record
from loadtest.benchmark.scratch import add_flag, scratch
from loadtest.benchmark.systems import demo_keys
from loadtest.workloads.mix import MIXED, schedule

WINDOW_S = 10.0
CHECK_S = 2.0
COOLDOWN_S = 8.0  # after a node joins or leaves, the signal is given time to see it
LOW_CHECKS = 10  # scale in after the signal asked for fewer nodes this many checks in a row
SECRET = "bench-autoscale-secret-0123456789"


class Controller:
    """Starts and stops registering agents for the spare nodes, as the demand signal says."""

    def __init__(self, stack: Stack, spares: list[dict[str, Any]], model: str, run: Path) -> None:
        self.stack, self.spares, self.model, self.run_dir = stack, spares, model, run
        self.agents: list[subprocess.Popen[bytes]] = []
        self.timeline: list[tuple[float, int, int]] = []  # (t, serving, needed)
        self.last_action = -COOLDOWN_S
        self.low = 0  # consecutive checks with more nodes than needed
        self.verbose = False

    def demand(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.stack.sidecar_url}/status.json", timeout=5) as r:
            return dict(json.load(r)["demand"].get(self.model, {}))

    def step(self, t: float) -> None:
        d = self.demand()
        serving, needed = int(d.get("serving", 0)), int(d.get("needed", 0))
        self.timeline.append((t, serving, needed))
        if self.verbose:
            print(f"{t:6.1f}s  {d}", flush=True)
        self.low = self.low + 1 if needed < serving else 0
        if t - self.last_action < COOLDOWN_S:
            return
        if needed > serving and len(self.agents) < len(self.spares):
            self.agents.append(self.register(self.spares[len(self.agents)], len(self.agents)))
            self.last_action = t
            print(f"{t:6.1f}s  needed {needed} > serving {serving}: registering a node", flush=True)
        elif self.low >= LOW_CHECKS and self.agents:
            agent = self.agents.pop()
            agent.send_signal(signal.SIGTERM)  # drains, waits for its requests, deregisters
            self.last_action, self.low = t, 0
            print(f"{t:6.1f}s  needed {needed} < serving {serving}: a node leaves", flush=True)

    def register(self, entry: dict[str, Any], i: int) -> subprocess.Popen[bytes]:
        args = [sys.executable, "-m", "admission.cli", "agent", "--policy"]
        args += [str(self.stack.runtime_policy), "--register", "--node-id", f"spare-{i}"]
        args += ["--url", entry["url"], "--models", self.model, "--grace-s", "60"]
        args += ["--max-inflight", str(entry["max_inflight"]), "--device-url", entry["device_url"]]
        with open(self.run_dir / f"agent-spare-{i}.log", "ab") as log:
            return subprocess.Popen(args, stdout=log, stderr=log)

    async def run(self, stop: asyncio.Event, t0: float) -> None:
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.step, time.monotonic() - t0)
            except OSError as exc:
                print(f"controller: {exc}", flush=True)
            try:
                await asyncio.wait_for(stop.wait(), CHECK_S)
            except TimeoutError:
                pass

    def stop(self) -> None:
        for a in self.agents:
            stop_process(a)


def windows(
    records: list[Record], targets: dict[str, float | None], timeline: list[tuple[float, int, int]]
) -> str:
    """Per WINDOW_S of sending and per class: the share served within its first-token target
    (served at all for a class without one), the refusals of every class, and the nodes serving
    (needed) as the controller read them."""
    end = max((r.sent_s for r in records), default=0.0)
    head = " | ".join(f"{c} in target" for c in targets)
    lines = [f"| window | sent | {head} | refused | nodes serving (needed) |"]
    lines.append("|---|---:|" + "---:|" * len(targets) + "---:|---|")
    w = 0.0
    while w <= end:
        here = [r for r in records if w <= r.sent_s < w + WINDOW_S]
        shares = []
        for cls, ttft_s in targets.items():
            mine = [r for r in here if r.cls == cls]
            ok = sum(1 for r in mine if r.ok and (ttft_s is None or (r.ttft_s or 0) <= ttft_s))
            shares.append(f"{100 * ok / len(mine):.1f} %" if mine else "–")
        refused = sum(1 for r in here if r.status in (429, 503))
        seen = [(s, n) for t, s, n in timeline if w <= t < w + WINDOW_S]
        nodes = ", ".join(f"{s} ({n})" for s, n in seen[:2]) or "–"
        row = " | ".join(shares)
        lines.append(
            f"| {w:.0f}–{w + WINDOW_S:.0f} s | {len(here)} | {row} | {refused} | {nodes} |"
        )
        w += WINDOW_S
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--start-nodes", type=int, default=2, help="nodes listed in the policy")
    ap.add_argument("--spare", type=int, default=3, help="nodes the controller may register")
    ap.add_argument("--load", type=float, default=2.0, help="× the listed nodes' capacity")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--idle-s", type=float, default=40, help="quiet time after the load")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--profile", default="a100-40gb-llama3-8b")
    ap.add_argument("--no-scale", action="store_true", help="the listed nodes alone")
    ap.add_argument("--verbose", action="store_true", help="print the signal at every check")
    add_flag(ap)
    a = ap.parse_args(argv)
    logging.getLogger("admission.policy").setLevel(logging.ERROR)
    rate = capacity(a.profile, kinds=MIXED) * a.start_nodes * a.load
    reqs = schedule(rate, a.seconds, seed=a.seed, kinds=MIXED)
    print(f"{len(reqs)} requests at {rate:.1f}/s ({a.load}× {a.start_nodes} nodes)", flush=True)
    work = scratch("autoscale-", a.keep_work)
    run = work / "run"
    run.mkdir(parents=True)
    model = PROFILES[a.profile].model
    nodes = NodeSet(a.start_nodes + a.spare, run, profile=a.profile)
    secret = work / "discovery.secret"
    secret.write_text(SECRET + "\n")
    raw = yaml.safe_load(BENCH_POLICY.read_text())
    tenants = {k: {**v, "models": [model]} for k, v in raw["tenants"].items()}
    discovery = {"enabled": True, "allow": ["127.0.0.0/8"], "secret_file": str(secret)}
    listed = {
        f"node-{i}": node_entry(p, model, "sim", 256, a.profile)
        for i, p in enumerate(nodes.ports[: a.start_nodes])
    }
    spares = [node_entry(p, model, "sim", 256, a.profile) for p in nodes.ports[a.start_nodes :]]
    stack = Stack(
        BENCH_POLICY,
        run,
        external_nodes=listed,
        policy_overrides={"tenants": tenants, "discovery": discovery},
    )
    ctl = Controller(stack, spares, model, run)
    ctl.verbose = a.verbose
    try:
        stack.start()
        classes = load_policy(stack.runtime_policy).classes
        targets = {
            k.cls: (classes[k.cls].slo_ttft_ms / 1000 if classes[k.cls].slo_ttft_ms else None)
            for k in MIXED
        }

        async def go() -> Any:
            stop, t0 = asyncio.Event(), time.monotonic()
            task = None if a.no_scale else asyncio.create_task(ctl.run(stop, t0))
            url = f"{stack.url}/v1/chat/completions"
            keys = demo_keys(BENCH_POLICY)
            res = await drive(url, reqs, keys, None, "admission", model, nodes.ports, None)
            await asyncio.sleep(a.idle_s)  # quiet: the signal falls, nodes leave
            stop.set()
            if task is not None:
                await task
            return res

        res = asyncio.run(go())
        lost = sum(1 for r in res.records if r.lost)
        print(windows(res.records, targets, ctl.timeline))
        left = [x for x in ctl.timeline if x[0] > a.seconds]
        print(
            f"lost {lost} of {len(res.records)}; nodes serving at the end: "
            f"{left[-1][1] if left else '–'}",
            flush=True,
        )
        return 1 if lost else 0
    finally:
        ctl.stop()
        stack.stop()
        nodes.stop()


if __name__ == "__main__":
    sys.exit(main())
