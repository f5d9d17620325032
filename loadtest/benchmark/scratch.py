"""A benchmark's scratch directory: configs, logs, Redis data, a generated model.

Removed when the process exits — tens of MB per run add up on a planner's disk — unless the run
died with an exception, found a failure (`keep`), or was asked to keep it (`--keep-work`); then
its path is printed.

Making one also makes SIGTERM (`kill`, `timeout`, a CI runner's cancel) exit the benchmark
through its `finally` blocks, as Ctrl-C does: the nodes, NGINX, Redis and sidecars it started
are stopped (they run in sessions of their own, so nothing else reaches them). Before, a
benchmark killed with SIGTERM left its whole stack running.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path


def add_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--keep-work",
        action="store_true",
        help="keep the run's scratch directory (configs and logs of every process)",
    )


_KEPT: set[Path] = set()


def keep(work: Path) -> None:
    """Keep `work` when the process exits: the run found something to look at."""
    _KEPT.add(work)


def scratch(prefix: str, keep_work: bool) -> Path:
    work = Path(tempfile.mkdtemp(prefix=prefix))

    def done() -> None:
        if keep_work or work in _KEPT or hasattr(sys, "last_value"):  # an uncaught exception
            print(f"scratch directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    atexit.register(done)
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return work


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
