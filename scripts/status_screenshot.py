"""Make docs/status-page.png: the status page of a local stack under the benchmark's mixed
overload (2 emulated nodes, 1.5× capacity), rendered by headless Chromium mid-run.

    .venv/bin/python scripts/status_screenshot.py [--out docs/status-page.png]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from devstack.stack import DEFAULT_POLICY, Stack
from loadtest.benchmark.capacity import capacity
from loadtest.benchmark.driver import drive
from loadtest.workloads.mix import schedule


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/status-page.png")
    ap.add_argument("--after-s", type=float, default=15.0, help="screenshot this far into the run")
    a = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("needs chromium")
    stack = Stack(DEFAULT_POLICY, Path(tempfile.mkdtemp(prefix="shot-")), nodes=2)
    try:
        stack.start()
        rate = capacity("a100-40gb-llama3-8b") * 2 * 1.5
        reqs = schedule(rate, a.after_s + 10)
        keys = {
            "acme": "sk-demo-acme",
            "globex": "sk-demo-globex",
            "hobbyist": "sk-demo-hobbyist",
            "nightly-etl": "sk-demo-etl",
        }
        out = Path(a.out).resolve()

        def shoot() -> None:
            time.sleep(a.after_s)
            subprocess.run(
                [
                    chromium,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--hide-scrollbars",
                    "--virtual-time-budget=3000",
                    "--window-size=1280,860",
                    f"--screenshot={out}",
                    f"{stack.sidecar_url}/status",
                ],
                check=True,
                capture_output=True,
            )

        t = threading.Thread(target=shoot)
        t.start()
        asyncio.run(
            drive(
                f"{stack.url}/v1/chat/completions",
                reqs,
                keys,
                None,
                "admission",
                "llama-3-8b",
                stack.node_ports,
                None,
            )
        )
        t.join()
        print(out)
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
