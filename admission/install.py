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


def cmd_k8s_manifests(args: argparse.Namespace) -> int:
    """Render the Kubernetes manifests for this policy into --out (a kustomize base)."""
    from admission import kubernetes as k8s

    policy = load_policy(args.policy)
    cluster = k8s.Cluster(
        image=args.image,
        namespace=args.namespace,
        redis_url=args.redis_url,
        prometheus_url=args.prometheus_url,
        edge_replicas=args.edge_replicas,
        max_nodes=args.max_nodes,
        grace_s=args.grace_s,
        models=tuple(args.model or ()),
    )
    if not (cluster.models or k8s.served_models(policy)):
        raise CommandError(
            "the policy names no model (no listed node, no tenant's models): name the models "
            "to deploy vLLM for with --model (repeatable)"
        )
    files = k8s.render(policy, Path(args.policy).read_text(), cluster)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in k8s.written_before(out) - set(files):  # a render of the past: e.g. redis.yaml
        (out / stale).unlink(missing_ok=True)
        print(f"{out / stale} removed")
    for name, objs in files.items():
        (out / name).write_text(k8s.dump(objs))
        print(out / name)
    if not policy.discovery.enabled:
        print(
            "note: the policy's discovery.enabled is false, so the vLLM pods' agents cannot "
            "register: set discovery: {enabled: true, allow: [<the pod network>], secret_file: "
            "...} (docs/operations.md, Running on Kubernetes)"
        )
    print(
        f"Then: kubectl create namespace {args.namespace}; kubectl -n {args.namespace} create "
        f"secret generic {k8s.SECRETS} --from-file=admin-token=<file> "
        f"--from-file=discovery-secret=<file>; kubectl apply -k {out}"
    )
    return 0


def _exe(args: argparse.Namespace) -> str:
    return getattr(args, "admission", None) or str(Path(sys.executable).with_name("admission"))
