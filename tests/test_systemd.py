"""The shipped systemd units, rendered for this installation, pass `systemd-analyze verify`
(syntax, directives, and that ExecStart points at an executable) without a single warning."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devstack.stack import DEFAULT_POLICY


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_rendered_units_verify_cleanly(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "admission.cli",
            "systemd-units",
            "--out",
            str(tmp_path),
            "--policy",
            str(DEFAULT_POLICY),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    names = sorted(Path(p).name for p in out)
    assert names == [
        "admission-agent.service",
        "admission-batch-worker@.service",
        "admission-sidecar@.service",
    ]
    text = (tmp_path / "admission-sidecar@.service").read_text()
    assert "@@" not in text and "Restart=always" in text and "NoNewPrivileges=yes" in text
    assert "--admit-unix /run/admission/admit-%i.sock" in text  # the edge's admission socket
    # A template is verified through an instance of it.
    shutil.copy(tmp_path / "admission-sidecar@.service", tmp_path / "admission-sidecar@0.service")
    shutil.copy(
        tmp_path / "admission-batch-worker@.service", tmp_path / "admission-batch-worker@0.service"
    )
    units = [
        str(tmp_path / "admission-agent.service"),
        str(tmp_path / "admission-sidecar@0.service"),
        str(tmp_path / "admission-batch-worker@0.service"),
    ]
    r = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr.strip() == "" and r.stdout.strip() == "", r.stderr
    # The check has teeth: a bad directive is reported.
    bad = tmp_path / "bad.service"
    bad.write_text(text.replace("Restart=always", "Restart=sometimes").replace("%i", "0"))
    r = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, text=True)
    assert "restart specifier" in r.stderr
