"""`admission demo` and `admission bench`, registered through the `admission.commands` entry
point group (see pyproject.toml)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from devstack.cli import add_stack_args, cmd_up


def cmd_demo(args: argparse.Namespace) -> int:
    """A mixed overload through FIFO, vLLM's priority scheduling with least_conn and its queue
    valve (what a vLLM user already has), and the admission stack; then the stack stays up."""
    from loadtest.bench import main as bench_main

    out = Path(args.run_dir).resolve().parent / "demo-report"
    print(
        f"demo: {args.seconds:g} s of mixed overload (1.5x capacity) on {args.nodes} emulated "
        "A100 nodes through plain NGINX round-robin (FIFO), through vLLM priority scheduling "
        "behind least_conn with its queue valve, and through the admission stack ...",
        flush=True,
    )
    rc = bench_main(
        [
            "--systems",
            "fifo,vllm_priority_lc,admission",
            "--nodes",
            str(args.nodes),
            "--seconds",
            str(args.seconds),
            "--out",
            str(out),
        ]
    )
    if rc or args.no_serve:
        return rc
    print("\nnow serving the stack for you to try (Ctrl-C stops everything):", flush=True)
    return cmd_up(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from loadtest.bench import main as bench_main

    return bench_main(args.rest)


def register(sub: Any) -> None:
    d = sub.add_parser(
        "demo", help="benchmark FIFO, vLLM priority and admission, then run the stack"
    )
    add_stack_args(d, ["sim"])
    d.add_argument("--nodes", type=int, default=4)
    d.add_argument("--seconds", type=float, default=30)
    d.add_argument("--no-serve", action="store_true", help="exit after the report")
    d.set_defaults(fn=cmd_demo)

    b = sub.add_parser(
        "bench", help="the four-system benchmark (`admission bench --help`)", add_help=False
    )
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
