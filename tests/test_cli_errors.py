"""Every command fails with a sentence (issue 63): `--help` works on each subcommand, and the
common mistakes of each end in one line saying what to do, exit status 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devstack.procs import free_port

ADMISSION = str(Path(sys.executable).with_name("admission"))


def _subcommands() -> list[str]:
    """Every subcommand the parser knows, plugins (up, demo, bench) included."""
    import argparse

    from admission.cli import build_parser

    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


SUBCOMMANDS = _subcommands()


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ADMISSION, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        cwd="/",
    )


def test_the_subcommands_are_all_here() -> None:
    assert {"serve", "agent", "node", "monitoring", "nginx-snippets", "up", "bench"} <= set(
        SUBCOMMANDS
    )


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_help_on_every_subcommand(cmd: str) -> None:
    r = run(cmd, "--help")
    assert r.returncode == 0, (cmd, r.stderr)
    assert "usage" in r.stdout.lower() and "Traceback" not in r.stderr


def mistakes(tmp: Path) -> list[tuple[list[str], str]]:
    """(arguments, a word the guidance must contain) per common mistake."""
    nope = str(tmp / "nope.yaml")
    short = tmp / "short.token"
    short.write_text("abc\n")
    taken = tmp / "taken.token"
    taken.write_text("x" * 40)
    dead = f"http://127.0.0.1:{free_port()}"
    return [
        (["serve", "--policy", nope], "--policy"),
        (["agent", "--policy", nope], "--policy"),
        (["nginx-snippets", "--policy", nope, "--out", str(tmp / "out")], "--policy"),
        (["batch-worker", "--policy", nope, "--edge-socket", "/run/x.sock"], "--policy"),
        (["node", "list", "--sidecar", dead], "--sidecar"),
        (["node", "drain", "n1", "--sidecar", dead], "--sidecar"),
        (["node", "drain", "n1", "--token-file", str(short)], "admin-token"),
        (["node", "drain", "n1", "--token-file", str(tmp / "none.token")], "create it"),
        (["serve", "--policy", nope, "--port", "1", "--host", "0.0.0.0"], "--policy"),
        (["admin-token", str(taken)], "--force"),
        (["systemd-units", "--out", "/proc/nope/units"], "create it"),
        (["monitoring", "--out", "/proc/nope/monitoring"], "create it"),
        (["serve"], "--policy"),  # the default path, /etc/admission/policies.yaml, is missing
    ]


def test_common_mistakes_are_one_sentence_and_status_2(tmp_path: Path) -> None:
    for args, hint in mistakes(tmp_path):
        r = run(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr, (args, r.stderr)
        assert len(lines) == 1 and hint in lines[0], (args, r.stderr)


def test_a_refused_token_says_where_the_token_comes_from(tmp_path: Path) -> None:
    """A live sidecar with an admin token, asked without one: the 401 becomes a sentence."""
    from devstack.stack import DEFAULT_POLICY, Stack

    stack = Stack(DEFAULT_POLICY, tmp_path / "stack", nodes=1)
    stack.start()
    try:
        r = run("node", "drain", "node-0", "--sidecar", stack.sidecar_url)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "--token-file" in r.stderr and "ADMISSION_ADMIN_TOKEN" in r.stderr
        r = run(
            "node",
            "undrain",
            "node-0",
            "--sidecar",
            stack.sidecar_url,
            env={"ADMISSION_ADMIN_TOKEN": stack.admin_token},
        )
        assert r.returncode == 0, r.stderr
    finally:
        stack.stop()


def test_admin_token_writes_a_private_token(tmp_path: Path) -> None:
    path = tmp_path / "admin.token"
    r = run("admin-token", str(path))
    assert r.returncode == 0, r.stderr
    assert len(path.read_text().strip()) >= 16 and (path.stat().st_mode & 0o777) == 0o600


def test_the_agent_reloads_its_policy_on_sighup(tmp_path: Path, redis_server: Any) -> None:
    """`systemctl reload admission-agent` sends SIGHUP: the agent reads the policy again and
    lives on (it died of the signal before)."""
    import signal
    import time

    from tests.conftest import BASE_POLICY

    policy = tmp_path / "policies.yaml"
    policy.write_text(BASE_POLICY.replace("REDIS_URL", redis_server.url))
    proc = subprocess.Popen(
        [ADMISSION, "agent", "--policy", str(policy)], stderr=subprocess.PIPE, text=True
    )
    try:
        time.sleep(1.5)
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=10)
    assert "reloaded" in err, err


def test_the_minimal_example_policy_checks_and_monitoring_writes_its_files(tmp_path: Path) -> None:
    policy = tmp_path / "policies.yaml"
    policy.write_text(run("example-policy", "--minimal").stdout)
    r = run("check", str(policy))
    assert r.returncode == 0 and r.stdout.startswith("ok: 2 tenants, 1 classes"), r
    assert "sk-" not in policy.read_text().replace("sk-...", "")  # no usable key in it
    r = run("monitoring", "--out", str(tmp_path / "mon"))
    assert r.returncode == 0, r.stderr
    import yaml

    rules = yaml.safe_load((tmp_path / "mon" / "alerts.yaml").read_text())
    assert any(g["rules"] for g in rules["groups"])
    assert (tmp_path / "mon" / "dashboard.json").read_text().startswith("{")


def test_serve_creates_its_socket_directory(tmp_path: Path, redis_server: Any) -> None:
    from devstack.procs import wait_for
    from tests.conftest import BASE_POLICY

    policy = tmp_path / "policies.yaml"
    policy.write_text(BASE_POLICY.replace("REDIS_URL", redis_server.url))
    sock = tmp_path / "run" / "admission" / "sidecar-0.sock"
    proc = subprocess.Popen([ADMISSION, "serve", "--policy", str(policy), "--unix", str(sock)])
    try:
        wait_for(sock.exists, 20, "sidecar socket", proc)
        assert (sock.parent.stat().st_mode & 0o777) == 0o750
    finally:
        proc.terminate()
        proc.wait(timeout=10)
