"""The commands that write an installation's files: systemd units, the edge's NGINX files (with
the commands of the processes they expect), the alert rules and dashboard, an admin token, and
the example policy. Each writes what it is asked for and prints where."""

from __future__ import annotations

import argparse
import grp
import os
import secrets
import sys
from importlib import resources
from pathlib import Path

from admission.cli_errors import CommandError
from admission.policy import load_policy


def cmd_admin_token(args: argparse.Namespace) -> int:
    """Write a new random admin token to FILE, readable by its owner (and --group) only."""
    path = Path(args.file)
    if path.exists() and not args.force:
        raise CommandError(f"{path} exists — pass --force to replace its token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    if args.group:
        os.chown(path, -1, grp.getgrnam(args.group).gr_gid)
        os.chmod(path, 0o640)
    print(f"{path}: a new admin token (serve --admin-token-file, node --token-file)")
    return 0


def cmd_example_policy(args: argparse.Namespace) -> int:
    """The shipped policy: every key explained, or (--minimal) keys and limits only."""
    name = "policies.minimal.yaml" if args.minimal else "policies.yaml"
    sys.stdout.write(resources.files("admission").joinpath(name).read_text())
    return 0


def cmd_systemd_units(args: argparse.Namespace) -> int:
    """Render the shipped systemd units for this installation into --out."""
    from admission import snippets

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policy, socket_dir = Path(args.policy).absolute(), Path(args.socket_dir)
    for name, text in snippets.units(_exe(args), policy, socket_dir, args.group).items():
        (out / name).write_text(text)
        print(out / name)
    return 0


def cmd_nginx_snippets(args: argparse.Namespace) -> int:
    """Render the edge's NGINX files for this installation into --out, the units and commands
    of the processes they expect, and say what else to do."""
    from admission import snippets

    policy = load_policy(args.policy)
    path = Path(args.policy).absolute()
    out, socket_dir = Path(args.out).resolve(), Path(args.socket_dir)
    for written in snippets.render(policy, out, args.sidecars, socket_dir):
        print(written)
    (out / "systemd").mkdir(exist_ok=True)
    token = Path(args.admin_token_file).absolute() if args.admin_token_file else None
    for name, text in snippets.units(_exe(args), path, socket_dir, args.group, token).items():
        (out / "systemd" / name).write_text(text)
        print(out / "systemd" / name)
    run = snippets.commands(_exe(args), path, socket_dir, args.group, args.sidecars, token)
    print(snippets.note(out, socket_dir, args.group, run))
    return 0


def cmd_monitoring(args: argparse.Namespace) -> int:
    """Write the shipped Prometheus alert rules and Grafana dashboard into --out."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("alerts.yaml", "dashboard.json"):
        text = resources.files("admission").joinpath("monitoring", name).read_text()
        (out / name).write_text(text)
        print(out / name)
    return 0


def _exe(args: argparse.Namespace) -> str:
    return getattr(args, "admission", None) or str(Path(sys.executable).with_name("admission"))
