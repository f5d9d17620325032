"""The `admission` command: check, serve, agent, node, and the commands that write an install.

Development commands (`up`, `demo`, `bench`) come from other installed packages through the
`admission.commands` entry point group: the product never imports them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import entry_points

from admission.cli_errors import run
from admission.errors import PolicyError
from admission.install import (
    cmd_admin_token,
    cmd_example_policy,
    cmd_k8s_manifests,
    cmd_monitoring,
    cmd_nginx_snippets,
    cmd_systemd_units,
)
from admission.policy import load_policy
from admission.processes import cmd_agent, cmd_batch_worker, cmd_node, cmd_serve
from admission.snippets import ADMIN_PORT, POLICY_PATH, SOCKET_DIR

# Every command reads the one policy path of a production install unless told otherwise.
DEFAULT_POLICY = os.environ.get("ADMISSION_POLICY", POLICY_PATH)
DEFAULT_SIDECAR = os.environ.get("ADMISSION_SIDECAR", f"http://127.0.0.1:{ADMIN_PORT}")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def cmd_check(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.path)
        old = load_policy(args.diff) if args.diff else None
    except PolicyError as exc:
        for problem in exc.problems:
            print(problem)
        return 1
    if old is not None:
        from admission.policy.diff import describe

        changes = describe(old, policy)
        for line in changes or ["no change in meaning"]:
            print(line)
        return 0
    print(
        f"ok: {len(policy.tenants)} tenants, {len(policy.classes)} classes, "
        f"{len(policy.nodes)} nodes"
    )
    return 0


POLICY_HELP = f"the policy file (default: $ADMISSION_POLICY or {POLICY_PATH})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="admission", description=__doc__)
    p.add_argument("--log-level", default="info")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("check", help="validate a policies.yaml; exit 1 listing every problem")
    c.add_argument("path")
    c.add_argument("--diff", metavar="OLD", help="also say what changes from OLD, in plain words")
    c.set_defaults(fn=cmd_check)

    s = sub.add_parser("serve", help="run the admission sidecar")
    s.add_argument("--policy", default=DEFAULT_POLICY, help=POLICY_HELP)
    s.add_argument("--unix", help="listen on this unix socket")
    s.add_argument(
        "--admit-unix", help="the edge's admission socket (JSON lines; NGINX's admit.lua uses it)"
    )
    s.add_argument(
        "--socket-mode",
        default="0660",
        help="permissions of the unix socket, octal (default 0660: owner and group)",
    )
    s.add_argument(
        "--socket-group",
        help="group of the unix sockets: NGINX's workers' (default: the sidecar's)",
    )
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="admin port address (loopback unless --admin-token-file is given)",
    )
    s.add_argument("--port", type=int, help="admin port: health, metrics, nodes, status page")
    s.add_argument(
        "--admin-token-file", help="file holding the bearer token that node admin over TCP requires"
    )
    s.add_argument(
        "--edge-over-tcp",
        action="store_true",
        help="also take /admit and /release on the TCP port (benchmarks, tests)",
    )
    s.add_argument("--edge-table", help="write the edge's tenant table here (JSON) on each load")
    s.set_defaults(fn=cmd_serve)

    a = sub.add_parser("agent", help="run a node agent (NVML + vLLM metrics → Redis)")
    a.add_argument("--policy", default=DEFAULT_POLICY, help=POLICY_HELP)
    a.add_argument("--node", action="append", help="node id to sample (repeatable; default all)")
    a.add_argument("--period-s", type=float, default=0.2)
    env = os.environ.get
    a.add_argument(
        "--register", action="store_true", help="register the node below (policy discovery:)"
    )
    a.add_argument("--node-id", default=env("ADMISSION_NODE_ID"), help="$ADMISSION_NODE_ID")
    a.add_argument("--url", default=env("ADMISSION_NODE_URL"), help="its vLLM's base URL")
    a.add_argument("--models", default=env("ADMISSION_NODE_MODELS"), help="comma-separated")
    a.add_argument("--pool", default=env("ADMISSION_NODE_POOL"), help="a pool of the policy")
    max_inflight = env("ADMISSION_NODE_MAX_INFLIGHT")
    a.add_argument(
        "--max-inflight",
        type=int,
        default=int(max_inflight) if max_inflight else None,
        help="default: discovery.defaults, else 64",
    )
    a.add_argument(
        "--memory-source",
        default=env("ADMISSION_NODE_MEMORY_SOURCE"),
        help="default: discovery.defaults, else effective",
    )
    a.add_argument("--device-url", default=env("ADMISSION_NODE_DEVICE_URL"), help="emulator only")
    a.add_argument(
        "--grace-s",
        type=float,
        default=float(env("ADMISSION_DRAIN_GRACE_S", "30")),
        help="on SIGTERM, wait this long for the node's requests to end before leaving",
    )
    a.set_defaults(fn=cmd_agent)

    n = sub.add_parser("node", help="operate nodes through a sidecar: list, drain, undrain")
    n.add_argument("action", choices=["list", "drain", "undrain"])
    n.add_argument("node", nargs="?")
    n.add_argument(
        "--sidecar",
        default=DEFAULT_SIDECAR,
        help=f"a sidecar's admin URL (default: $ADMISSION_SIDECAR or {DEFAULT_SIDECAR})",
    )
    n.add_argument("--token-file", help="admin token (default: $ADMISSION_ADMIN_TOKEN)")
    n.set_defaults(fn=cmd_node)

    w = sub.add_parser("batch-worker", help="run OpenAI batch lines through the edge")
    w.add_argument("--policy", default=DEFAULT_POLICY, help=POLICY_HELP)
    w.add_argument(
        "--edge-socket",
        required=True,
        help="the edge's internal unix socket (the server with the trusted tenant)",
    )
    w.add_argument("--concurrency", type=int, default=16, help="most lines in flight (fewer: busy)")
    w.add_argument("--claim-idle-s", type=float, default=30.0, help="take over a silent worker's")
    w.set_defaults(fn=cmd_batch_worker)

    t = sub.add_parser("admin-token", help="write a new admin token to a file (mode 0600)")
    t.add_argument("file", help="where to write it, e.g. /etc/admission/admin.token")
    t.add_argument("--group", help="a group that may read it too (mode 0640)")
    t.add_argument("--force", action="store_true", help="replace the token of an existing file")
    t.set_defaults(fn=cmd_admin_token)
    e = sub.add_parser("example-policy", help="print the policies.yaml shipped with the package")
    e.add_argument(
        "--minimal", action="store_true", help="keys and limits only: a team's starting point"
    )
    e.set_defaults(fn=cmd_example_policy)

    u = sub.add_parser("systemd-units", help="write systemd units for this installation")
    u.add_argument("--out", required=True, help="directory, e.g. /etc/systemd/system")
    u.add_argument("--policy", default=DEFAULT_POLICY, help=POLICY_HELP)
    u.add_argument("--socket-dir", default=SOCKET_DIR, help="where the sidecars' sockets are")
    u.add_argument("--group", default="www-data", help="NGINX's workers' group")
    u.add_argument("--admission", help="path of the admission command (default: this one)")
    u.set_defaults(fn=cmd_systemd_units)

    n = sub.add_parser("nginx-snippets", help="write the edge's NGINX files for this installation")
    n.add_argument("--out", required=True, help="directory, e.g. /etc/nginx/admission")
    n.add_argument("--policy", default=DEFAULT_POLICY, help=POLICY_HELP)
    n.add_argument("--sidecars", type=int, default=2, help="sidecar processes (units @0..N-1)")
    n.add_argument("--socket-dir", default=SOCKET_DIR, help="where their sockets are")
    n.add_argument("--group", default="www-data", help="NGINX's workers' group")
    n.add_argument("--admission", help="path of the admission command (default: this one)")
    n.add_argument("--admin-token-file", help="the sidecars' admin token (`admission admin-token`)")
    n.set_defaults(fn=cmd_nginx_snippets)

    m = sub.add_parser("monitoring", help="write the Prometheus alert rules and Grafana dashboard")
    m.add_argument("--out", required=True, help="directory, e.g. /etc/prometheus/admission")
    m.set_defaults(fn=cmd_monitoring)

    k = sub.add_parser("k8s-manifests", help="write Kubernetes manifests for this policy")
    k.add_argument("--out", required=True, help="directory (a kustomize base: kubectl apply -k)")
    k.add_argument("--policy", default=DEFAULT_POLICY, help=POLICY_HELP)
    k.add_argument("--image", required=True, help="the image holding NGINX and admission")
    k.add_argument("--namespace", default="admission")
    k.add_argument("--redis-url", help="an existing Redis (default: a one-pod trial StatefulSet)")
    k.add_argument(
        "--prometheus-url",
        default="http://prometheus-operated.monitoring.svc:9090",
        help="where KEDA reads the demand signal",
    )
    k.add_argument(
        "--model", action="append", help="deploy vLLM for it (repeatable; default: the policy's)"
    )
    k.add_argument("--edge-replicas", type=int, default=2)
    k.add_argument("--max-nodes", type=int, default=8, help="per model, the autoscaler's ceiling")
    k.add_argument("--grace-s", type=int, default=120, help="a leaving node's requests' time")
    k.set_defaults(fn=cmd_k8s_manifests)

    for ep in entry_points(group="admission.commands"):
        try:
            ep.load()(sub)
        except ImportError as exc:  # a broken plugin must not take the product's commands down
            logging.getLogger(__name__).warning("command plugin %s unavailable: %s", ep.name, exc)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a mistake the user can fix ends in one sentence (cli_errors.py)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not hasattr(args, "rest"):  # only pass-through commands (bench) take more
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.rest = [*extra, *args.rest]  # `bench --help`: argparse leaves options out of it
    _setup_logging(args.log_level)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
