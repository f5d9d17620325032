"""`admission up`: the whole stack locally, in the foreground, until Ctrl-C.

Registered with the `admission` command through the `admission.commands` entry point group,
so the product package never imports the development stack.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from admission.policy import load_policy
from devstack.stack import DEFAULT_POLICY, Stack


def add_stack_args(p: argparse.ArgumentParser, engines: list[str]) -> None:
    p.add_argument(
        "--policy",
        default=str(DEFAULT_POLICY),
        help="policies.yaml to run (default: the one shipped with the package)",
    )
    p.add_argument("--engine", choices=engines, default="sim")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--sidecars", type=int, default=2)
    p.add_argument("--redis-url", help="use this Redis instead of starting one")
    p.add_argument("--run-dir", default="run", help="logs, sockets and the live policy copy")


def cmd_up(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    stack = Stack(
        Path(args.policy),
        run_dir,
        engine=args.engine,
        nodes=args.nodes,
        port=args.port,
        sidecars=args.sidecars,
        redis_url=args.redis_url,
    )
    stop = False

    def on_signal(_sig: int, _frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack.start()
        policy = load_policy(stack.runtime_policy)
        print(f"\nadmission edge ready: {stack.url}/v1  (health: {stack.url}/healthz)")
        print(f"status page:   {stack.sidecar_url}/status   logs: {run_dir}")
        print(
            f"node admin:    admission node drain NODE --sidecar {stack.sidecar_url} "
            f"--token-file {stack.admin_token_file}"
        )
        for t in policy.tenants.values():
            for k in t.demo_keys:
                print(f"  tenant {t.id:<12} classes {','.join(t.classes):<18} key {k}")
        print("Ctrl-C stops everything.\n", flush=True)
        while not stop:
            # A child that dies is restarted with backoff; the stack keeps serving meanwhile
            # (the failure modes in docs/operations.md). Only Ctrl-C / SIGTERM stops it.
            for event in stack.supervise():
                print(f"{time.strftime('%H:%M:%S')} {event} (log: {run_dir})", flush=True)
            time.sleep(0.5)
    finally:
        stack.stop()
    return 0


def register(sub: Any) -> None:
    u = sub.add_parser("up", help="run the whole stack locally in the foreground")
    add_stack_args(u, ["sim", "vllm"])
    u.add_argument("--nodes", type=int, default=2)
    u.set_defaults(fn=cmd_up)
