"""The commands that run the product's processes — `serve` (a sidecar), `agent` (a node
agent, registering its node under `discovery:`), `batch-worker` — and `node`, which operates
nodes through a sidecar. The parser lives in cli.py; failures become sentences in cli_errors.py.
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
import urllib.request
from pathlib import Path
from typing import Any

from admission.cli_errors import CommandError
from admission.metrics import Metrics
from admission.policy import load_policy
from admission.trust import Access, is_loopback, read_token

# Connections NGINX may open at once before the sidecar accepts them. aiohttp's default (128)
# overflows under a burst of a few hundred clients: connect() on a full unix-socket backlog fails
# with EAGAIN and the edge used to answer 503 for traffic it could have queued. The kernel caps
# this at net.core.somaxconn (4096 on current kernels).
LISTEN_BACKLOG = 4096


def cmd_serve(args: argparse.Namespace) -> int:

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

    asyncio.run(_serve(app, args))
    return 0


async def _serve(app: Any, args: argparse.Namespace) -> None:
    """Serve `app` on the sockets `args` name (each 0660 to the socket group) until SIGTERM,
    then drain the edge's admissions."""
    from aiohttp import web

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


def cmd_agent(args: argparse.Namespace) -> int:
    from admission.nodes.agent import Agent
    from admission.store import connect

    policy = load_policy(args.policy)
    registration = _registration(args, policy) if args.register else None
    _use_uvloop()

    async def main() -> None:
        redis = connect(policy.redis)
        agent = Agent(redis, policy, args.node or None, args.period_s, registration)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, agent.reload_policy, args.policy)
        try:
            await agent.run(stop, args.grace_s)
        finally:
            await redis.aclose()

    asyncio.run(main())
    return 0


def _registration(args: argparse.Namespace, policy: Any) -> tuple[Any, bytes, dict[str, Any]]:
    """The node `agent --register` registers, checked as the sidecars will check it, the
    secret it is signed with and the spec it signs (what was given: the sidecars fill the rest
    from their policy's discovery.defaults)."""
    from admission.nodes.registry import read_secret
    from admission.policy.nodes import registered_node

    if not policy.discovery.enabled:
        raise CommandError("the policy's discovery.enabled is false: nodes cannot register")
    secret = read_secret(policy)
    if secret is None:
        raise CommandError(
            "no discovery secret: write one (16+ characters) to discovery.secret_file, or set "
            "$ADMISSION_DISCOVERY_SECRET"
        )
    if not (args.node_id and args.url and args.models):
        raise CommandError(
            "--register needs --node-id, --url and --models (or their $ADMISSION_NODE_*)"
        )
    spec: dict[str, Any] = {"url": args.url, "models": [m for m in args.models.split(",") if m]}
    for name in ("max_inflight", "memory_source", "pool", "device_url"):
        if getattr(args, name) not in (None, ""):  # given (0 too: the check refuses it)
            spec[name] = getattr(args, name)
    node, why = registered_node(policy, args.node_id, spec)
    if node is None:
        raise CommandError(f"node {args.node_id} cannot register: {why}")
    return node, secret, spec


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
