"""The `admission` command: check, serve, agent, node, example-policy.

Development commands (`up`, `demo`, `bench`) come from other installed packages through the
`admission.commands` entry point group: the product never imports them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import grp
import json
import logging
import os
import signal
import sys
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path

from admission.access import Access, is_loopback, read_token
from admission.cli_errors import CommandError, run
from admission.errors import PolicyError
from admission.install import (
    cmd_admin_token,
    cmd_example_policy,
    cmd_monitoring,
    cmd_nginx_snippets,
    cmd_systemd_units,
)
from admission.metrics import Metrics
from admission.policy import load_policy
from admission.snippets import ADMIN_PORT, POLICY_PATH, SOCKET_DIR

# Every command reads the one policy path of a production install unless told otherwise.
DEFAULT_POLICY = os.environ.get("ADMISSION_POLICY", POLICY_PATH)
DEFAULT_SIDECAR = os.environ.get("ADMISSION_SIDECAR", f"http://127.0.0.1:{ADMIN_PORT}")

# Connections NGINX may open at once before the sidecar accepts them. aiohttp's default (128)
# overflows under a burst of a few hundred clients: connect() on a full unix-socket backlog fails
# with EAGAIN and the edge used to answer 503 for traffic it could have queued. The kernel caps
# this at net.core.somaxconn (4096 on current kernels).
LISTEN_BACKLOG = 4096


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


def cmd_serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from admission.reload import PolicyHolder
    from admission.server import build_app

    policy = load_policy(args.policy)
    token = None
    if args.admin_token_file:
        try:
            token = read_token(args.admin_token_file)
        except (OSError, ValueError) as exc:
            raise CommandError(
                f"admin token: {exc} — write one with `admission admin-token FILE`"
            ) from None
    if args.port is not None and not is_loopback(args.host) and token is None:
        raise CommandError(
            f"refusing to serve the admin port on {args.host} without --admin-token-file "
            "(node admin would be open to the network)"
        )
    _raise_open_files()
    _use_uvloop()
    _socket_dirs(args.socket_group, args.unix, args.admit_unix, args.edge_table)
    holder = PolicyHolder(Path(args.policy), policy, Metrics())
    exposed = args.port is not None and not is_loopback(args.host)
    access = Access(edge_over_tcp=args.edge_over_tcp, admin_token=token, exposed=exposed)
    app = build_app(
        holder, edge_table=Path(args.edge_table) if args.edge_table else None, access=access
    )

    async def main() -> None:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        sites: list[web.BaseSite] = []
        if args.unix:
            Path(args.unix).unlink(missing_ok=True)
            sites.append(web.UnixSite(runner, args.unix, backlog=LISTEN_BACKLOG))
        if args.port is not None:
            sites.append(web.TCPSite(runner, args.host, args.port, backlog=LISTEN_BACKLOG))
        for s in sites:
            await s.start()
        names = [s.name for s in sites]
        edge = None
        if args.admit_unix:  # the edge's admissions: JSON lines (admission.edge_socket)
            from admission import edge_socket

            Path(args.admit_unix).unlink(missing_ok=True)
            edge = await edge_socket.serve(app, args.admit_unix, LISTEN_BACKLOG)
            names.append(f"unix:{args.admit_unix} (admissions)")
        for path in (args.unix, args.admit_unix):
            if path:
                # Only NGINX's workers should reach the sidecar: its group (--socket-group, or
                # the sidecar's own), mode 0660.
                if args.socket_group:
                    os.chown(path, -1, grp.getgrnam(args.socket_group).gr_gid)
                os.chmod(path, int(args.socket_mode, 8))
        logging.info("sidecar listening on %s", ", ".join(names))
        # Everything allocated so far lives as long as the process: keep it out of the
        # collector's generations so that collections on the request path stay short.
        gc.collect()
        gc.freeze()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        logging.info("stopping: draining in-flight admissions")
        if edge is not None:
            await edge_socket.drain(*edge, timeout_s=5.0)
        await runner.cleanup()

    asyncio.run(main())
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from admission.nodes.agent import Agent
    from admission.store import connect

    policy = load_policy(args.policy)
    _use_uvloop()

    async def main() -> None:
        redis = connect(policy.redis)
        agent = Agent(redis, policy, args.node or None, period_s=args.period_s)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, agent.reload_policy, args.policy)
        try:
            await agent.run(stop)
        finally:
            await redis.aclose()

    asyncio.run(main())
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    url = f"{args.sidecar.rstrip('/')}/nodes"
    if args.action == "list":
        with urllib.request.urlopen(url, timeout=5) as r:
            for n in json.load(r)["nodes"]:
                print(
                    f"{n['node']:<16} {n['state']:<12} mem {n['projected_memory']:.3f} "
                    f"inflight {n['inflight']}/{n['max_inflight']}"
                )
        return 0
    headers = {}
    token = os.environ.get("ADMISSION_ADMIN_TOKEN")
    if args.token_file:
        try:
            token = read_token(args.token_file)
        except ValueError as exc:
            raise CommandError(f"{exc} — write one with `admission admin-token FILE`") from None
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(
        f"{url}/{args.node}/{args.action}", method="POST", data=b"", headers=headers
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        print(r.read().decode())
    return 0


def cmd_batch_worker(args: argparse.Namespace) -> int:
    from admission.batch.worker import Worker
    from admission.reload import PolicyHolder
    from admission.store import connect_batch

    policy = load_policy(args.policy)
    _use_uvloop()

    async def main() -> None:
        holder = PolicyHolder(Path(args.policy), policy, Metrics())
        redis = connect_batch(policy.redis, policy.batch.redis_url)
        watcher = asyncio.create_task(holder.watch())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await Worker(redis, holder, args.edge_socket, args.concurrency, args.claim_idle_s).run(
                stop
            )
        finally:
            watcher.cancel()
            await redis.aclose()

    asyncio.run(main())
    return 0


def _socket_dirs(group: str | None, *paths: str | None) -> None:
    """Create the directories of the sidecar's sockets that do not exist yet: 0750, of the
    socket group (NGINX's workers go through it to the sockets), as systemd's RuntimeDirectory
    would. An existing one is left as it is."""
    for p in paths:
        d = Path(p).parent if p else None
        if d is None or d.exists():
            continue
        try:
            d.mkdir(mode=0o750, parents=True)
        except FileExistsError:  # another sidecar started beside this one made it
            continue
        if group:
            os.chown(d, -1, grp.getgrnam(group).gr_gid)


def _raise_open_files(want: int = 65536) -> None:
    """Every request waiting in the queue holds one admission connection from NGINX: lift the
    soft limit on open files (often 1,024) towards the hard one, so overload queues instead of
    refusing connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _use_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep serving without it
        pass


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
