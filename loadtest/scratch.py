"""A benchmark's scratch directory: configs, logs, Redis data, a generated model.

Removed when the process exits — tens of MB per run add up on a planner's disk — unless the run
died with an exception, found a failure (`keep`), or was asked to keep it (`--keep-work`); then
its path is printed.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import sys
import tempfile
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
    return work
