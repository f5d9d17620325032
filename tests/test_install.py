"""The README's commands the way a user runs them: a wheel built from a fresh clone, installed in
its own environment, console scripts run from a directory that is not the checkout.

The development install is editable (the checkout is on sys.path), so it cannot show a command
that works only from the checkout; this environment has the project's dependencies but not the
checkout, and the test asserts that `admission` is imported from the installed wheel.
"""

from __future__ import annotations

import os
import shutil
import signal
import site
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.procs import free_port, http_ok, wait_for
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """bin/ of a fresh environment holding the wheel of a fresh clone (dependencies borrowed
    from the development venv through a plain path entry, which runs none of its .pth hooks)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    tmp = tmp_path_factory.mktemp("install")
    clone = tmp / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    dist = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(clone)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env_dir = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    purelib = subprocess.run(
        [
            str(env_dir / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    wheel = next(dist.glob("admission-*.whl"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(env_dir / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    shutil.rmtree(clone)  # nothing may refer to it
    yield env_dir / "bin"


def _env(bindir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bindir}:{env.get('PATH', '')}"
    return env


def test_installed_package_is_not_the_checkout(installed: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [
            str(installed / "python"),
            "-c",
            "import admission, devstack, loadtest, engine; "
            "print(admission.__file__, devstack.__file__, loadtest.__file__, engine.__file__)",
        ],
        cwd=tmp_path,
        env=_env(installed),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(ROOT) not in out and out.count(str(installed.parent)) == 4


def test_console_script_lists_every_command_and_checks_the_shipped_policy(
    installed: Path, tmp_path: Path
) -> None:
    run = lambda *a: subprocess.run(  # noqa: E731
        [str(installed / "admission"), *a],
        cwd=tmp_path,
        env=_env(installed),
        capture_output=True,
        text=True,
        timeout=60,
    )
    helptext = run("--help").stdout
    for cmd in ("check", "serve", "agent", "node", "example-policy", "up", "demo", "bench"):
        assert cmd in helptext
    example = run("example-policy")
    assert example.returncode == 0 and "tenants:" in example.stdout
    (tmp_path / "policies.yaml").write_text(example.stdout)
    checked = run("check", "policies.yaml")
    assert checked.returncode == 0 and checked.stdout.startswith("ok:")


def test_demo_runs_from_the_installed_script(installed: Path, tmp_path: Path) -> None:
    """`make demo`'s command, short: the comparison runs and writes its report."""
    proc = subprocess.run(
        [str(installed / "admission"), "demo", "--seconds", "4", "--nodes", "1", "--no-serve"],
        cwd=tmp_path,
        env=_env(installed),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "demo-report" / "report.md").read_text()
    assert "| fifo |" in report and "| admission |" in report


def _processes_in(run_dir: Path) -> list[int]:
    """Pids of live processes whose working directory is inside `run_dir` (the stack's
    children all start there)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cwd = os.readlink(p / "cwd")
            state = (p / "stat").read_text().split(") ", 1)[1][0]
        except OSError:
            continue
        if cwd.startswith(str(run_dir)) and state != "Z":
            pids.append(int(p.name))
    return pids


def test_up_serves_and_ctrl_c_leaves_nothing_behind(installed: Path, tmp_path: Path) -> None:
    port = free_port()
    run_dir = tmp_path / "run"
    with open(tmp_path / "up.log", "wb") as log:
        proc = subprocess.Popen(
            [
                str(installed / "admission"),
                "up",
                "--nodes",
                "1",
                "--sidecars",
                "1",
                "--port",
                str(port),
                "--run-dir",
                str(run_dir),
            ],
            cwd=tmp_path,
            env=_env(installed),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), 90, "the stack", proc)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")
        with pytest.raises(urllib.error.HTTPError) as ei:  # no key: refused at the edge
            urllib.request.urlopen(req, timeout=5)
        assert ei.value.code == 401
        ei.value.close()
        assert _processes_in(run_dir)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while _processes_in(run_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_in(run_dir) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
