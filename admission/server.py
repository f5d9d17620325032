"""The sidecar's HTTP API (aiohttp): /admit, /release, /healthz, /metrics and node admin.

HTTP only: parse and validate, call the dispatcher (which owns the decision), map errors.
Resources start and stop in one place (`build_app`'s cleanup contexts, in dependency order:
Redis → policy watcher → dispatcher), and `error_middleware` is the one place where our errors
become HTTP answers (OpenAI-shaped JSON, Retry-After where retrying can help).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from admission import cache_salt, status
from admission.answer import DECIDER, Decider, error_body, loads, ratelimit_headers
from admission.batch.api import BatchApi
from admission.batch.store import BatchStore
from admission.errors import (
    AdmissionError,
    BadRequest,
    NotFound,
)
from admission.limits import Limiter
from admission.metrics import Metrics
from admission.nodes.registry import Membership
from admission.reload import PolicyHolder, write_edge_table
from admission.scheduling import Dispatcher
from admission.store import Store, connect_batch
from admission.trust import Access
from admission.usage import RefusedReleases, Release, release_args

log = logging.getLogger(__name__)

POLICY = web.AppKey("policy", PolicyHolder)
METRICS = web.AppKey("metrics", Metrics)
STORE = web.AppKey("store", Store)
DISPATCH_TASK = web.AppKey("dispatch_task", asyncio.Task[None])
LIMITER = web.AppKey("limiter", Limiter)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
ACCESS = web.AppKey("access", Access)
RECENT = web.AppKey("recent", status.Recent)
REFUSED_RELEASES = web.AppKey("refused_releases", RefusedReleases)

MAX_RELEASE_BATCH = 256


def error_response(exc: AdmissionError) -> web.Response:
    body = error_body(exc)
    headers = ratelimit_headers(exc.ratelimit)
    if (ra := exc.retry_after_s()) is not None:
        headers["Retry-After"] = str(ra)
    return web.json_response(body, status=exc.status, headers=headers)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except AdmissionError as exc:
        return error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        return error_response(BadRequest("request body too large", code="body_too_large"))


async def _json_body(request: web.Request) -> Any:
    return loads(await request.read())


def _json(doc: Any) -> web.Response:
    return web.Response(body=orjson.dumps(doc), content_type="application/json")


async def admit(request: web.Request) -> web.Response:
    request.app[ACCESS].check_edge(request)
    return _json(await request.app[DECIDER].decide(await request.read()))


async def release(request: web.Request) -> web.Response:
    """One release (an object) or a batch (an array, as the edge sends them): give the node
    lease back and settle the reservation. A malformed entry of a batch is answered on its own
    and does not hold the others back; settling is idempotent, so a batch may be resent whole."""
    request.app[ACCESS].check_edge(request)
    body = await _json_body(request)
    dispatcher = request.app[DISPATCHER]
    ratio = request.app[METRICS].prompt_ratio.observe
    if not isinstance(body, list):
        one = release_args(body, request.app[POLICY].current, ratio)
        refunded = (await dispatcher.release_many([one]))[0]
        return _json({"released": True, "refunded_tokens": refunded})
    if len(body) > MAX_RELEASE_BATCH:
        raise BadRequest(f"at most {MAX_RELEASE_BATCH} releases per batch", code="batch_too_large")

    results: list[dict[str, Any]] = []
    good: list[Release] = []
    policy = request.app[POLICY].current
    for entry in body:  # a malformed entry is answered on its own
        try:
            good.append(release_args(entry, policy, ratio))
            results.append({})
        except BadRequest as exc:
            results.append({"error": {"message": exc.message, "code": exc.code}})
            request.app[REFUSED_RELEASES].note(exc)
    refunds = iter(await dispatcher.release_many(good))
    for r in results:
        if "error" not in r:
            r["refunded_tokens"] = next(refunds)
    return _json({"released": len(good), "results": results})


async def healthz(request: web.Request) -> web.Response:
    """Readiness: 503 when the dispatcher task is not running (queued requests would only time
    out) or some model the policy serves has no node open or held (`no_capacity`: every one
    down, drained or in maintenance), or there is no node at all (the registered ones all
    left). `?brief=1` (what the public edge asks for) answers the status alone: node names and
    queue depth are for operators, on the admin port."""
    limiter = request.app[LIMITER]
    dispatcher = request.app[DISPATCHER]
    task = request.app[DISPATCH_TASK]
    served = request.app[POLICY].current.models()
    idle = sorted(m for m in served if dispatcher.nodes.live.get(m) == 0)
    # No node at all (every registered one gone, none listed) serves nothing either.
    state = "dispatcher_stopped" if task.done() else "no_capacity" if idle or not served else "ok"
    status = 200 if state == "ok" else 503
    if request.query.get("brief"):
        return web.json_response({"status": state}, status=status)
    return web.json_response(
        {
            "status": state,
            "models_without_nodes": idle,
            "redis": "degraded" if limiter.degraded else "ok",
            "queued": len(dispatcher.queue),
            "nodes": {v["node"]: v["state"] for v in dispatcher.nodes.snapshot()},
        },
        status=status,
    )


async def metrics_view(request: web.Request) -> web.Response:
    request.app[ACCESS].check_read(request)
    data = generate_latest(request.app[METRICS].registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def status_page(_request: web.Request) -> web.Response:
    """The page itself holds no figures (it reads status.json, which checks the token)."""
    return web.Response(text=status.page(), content_type="text/html")


async def status_view(request: web.Request) -> web.Response:
    request.app[ACCESS].check_read(request)
    app = request.app
    holder = app[POLICY]
    return web.json_response(
        status.snapshot(
            app[DISPATCHER], app[RECENT], holder.version, holder.loaded_at, app[LIMITER].degraded
        )
    )


async def nodes_view(request: web.Request) -> web.Response:
    request.app[ACCESS].check_read(request)
    nodes = request.app[DISPATCHER].nodes
    return web.json_response(
        {"nodes": nodes.snapshot(), "views_age_s": round(nodes.views_age(), 3)}
    )


async def node_admin(request: web.Request) -> web.Response:
    request.app[ACCESS].check_admin(request)
    node = request.match_info["node"]
    action = request.match_info["action"]
    if node not in request.app[POLICY].current.nodes:
        raise NotFound(f"no node {node!r} in the policy", code="node_not_found")
    if action not in ("drain", "undrain"):
        raise NotFound(f"unknown action {action!r}", code="not_found")
    await request.app[DISPATCHER].set_maintenance(node, action == "drain")
    log.warning("node %s: %s by operator", node, action)
    return web.json_response({"node": node, "maintenance": action == "drain"})


def build_app(
    holder: PolicyHolder,
    metrics: Metrics | None = None,
    edge_table: Path | None = None,
    access: Access | None = None,
) -> web.Application:
    """The sidecar application; resources open and close in its cleanup contexts (`_Life`).
    `access` defaults to what an in-process test client needs (the edge's calls over TCP);
    `serve` passes the production trust model (admission.trust)."""
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024)
    app[ACCESS] = access or Access(edge_over_tcp=True)
    app[RECENT] = status.Recent()
    app[REFUSED_RELEASES] = RefusedReleases()
    batches = BatchApi(holder, app[ACCESS])
    app[POLICY] = holder
    app[METRICS] = metrics or holder.metrics
    life = _Life(app, holder, edge_table, batches)
    app.cleanup_ctx.extend([life.redis, life.watcher, life.dispatcher])
    app.router.add_post("/admit", admit)
    app.router.add_post("/release", release)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/nodes", nodes_view)
    app.router.add_get("/status", status_page)
    app.router.add_get("/status.json", status_view)
    batches.add_routes(app)
    app.router.add_post("/nodes/{node}/{action}", node_admin)
    return app


class _Life:
    """The sidecar's resources and tasks, in the order they start (aiohttp cleanup contexts):
    Redis and the limiter; the policy watcher and the edge table; the dispatcher."""

    def __init__(
        self, app: web.Application, holder: PolicyHolder, edge_table: Path | None, batches: BatchApi
    ) -> None:
        self.app, self.holder, self.edge_table, self.batches = app, holder, edge_table, batches
        self.secret: bytes | None = None  # the cache salt secret (cache_salt.py), once read

    async def redis(self, app: web.Application) -> AsyncIterator[None]:
        holder, batches = self.holder, self.batches
        st = app[STORE] = Store.open(holder.current.redis, app[METRICS])
        pol = holder.current
        batches.store = BatchStore(connect_batch(pol.redis, pol.batch.redis_url))
        app[LIMITER] = Limiter(st, holder, app[METRICS])
        backlog = asyncio.create_task(st.backlog.run(), name="redis-backlog")
        backlog.add_done_callback(_log_death)
        yield
        await _stop(backlog)
        if len(st.backlog):  # one last try; what is left, the TTLs in Redis free
            try:
                await asyncio.wait_for(st.backlog.flush(), 2.0)
            except TimeoutError:
                pass
            if len(st.backlog):
                log.warning("stopping with %d releases Redis did not take", len(st.backlog))
        await st.close()
        await batches.store.redis.aclose()

    def unusable(self) -> frozenset[str]:
        return self.app[DISPATCHER].nodes.unusable if DISPATCHER in self.app else frozenset()

    def write_table(self, policy: Any, closed: frozenset[str] | None = None) -> None:
        if self.edge_table is not None:
            shut = self.unusable() if closed is None else closed
            write_edge_table(policy, self.edge_table, shut, self.secret)

    async def read_secret(self, attempts: int | None) -> None:
        """Read the shared cache salt secret (`attempts` tries; None: until it is read), then
        rewrite the edge table with the salts. Until then the edge salts every request alone."""
        delay_s, tried = 0.5, 0
        while attempts is None or tried < attempts:
            tried += 1
            try:
                self.secret = await asyncio.wait_for(
                    cache_salt.read_secret(self.app[STORE].redis), 2.0
                )
            except Exception as exc:  # Redis away: requests are salted alone meanwhile
                if tried == 1 and attempts is None:
                    log.warning(
                        "cannot read the cache salt secret from Redis (%s); each request is "
                        "its own prefix cache until it is read",
                        type(exc).__name__,
                    )
                await asyncio.sleep(delay_s)
                delay_s = min(5.0, delay_s * 2)
                continue
            self.write_table(self.holder.current)
            return

    async def watcher(self, app: web.Application) -> AsyncIterator[None]:
        holder = self.holder
        salting: asyncio.Task[None] | None = None
        if self.edge_table is not None:
            await self.read_secret(1)
            self.write_table(holder.current)
            holder.listeners.append(self.write_table)
            if self.secret is None:
                salting = asyncio.create_task(self.read_secret(None), name="cache-salt")
        task = asyncio.create_task(holder.watch(), name="policy-watcher")
        yield
        await _stop(task)
        if salting is not None:
            await _stop(salting)

    async def dispatcher(self, app: web.Application) -> AsyncIterator[None]:
        holder = self.holder
        d = Dispatcher(app[STORE], app[LIMITER], holder, app[METRICS])
        holder.listeners.append(d.set_policy)
        app[DISPATCHER] = d
        app[DECIDER] = Decider(holder, app[METRICS], d, app[LIMITER], app[RECENT])
        if self.edge_table is not None:  # nodes closing or opening change the edge's peers
            d.nodes.on_unusable = lambda closed: self.write_table(holder.current, closed)
        # Registered nodes (nodes/registry.py), read once before serving: a restarted sidecar
        # knows them at once.
        members = Membership(app[STORE].redis, lambda: holder.file_policy, holder.set_registered)
        try:
            await asyncio.wait_for(members.step(), 2.0)
        except Exception as exc:  # Redis away: its loop reads them when it answers
            log.warning("discovery: registry not read at start (%s)", type(exc).__name__)
        await d.nodes.refresh()
        task = app[DISPATCH_TASK] = asyncio.create_task(d.run(), name="dispatcher")
        task.add_done_callback(_log_death)
        probe = asyncio.create_task(app[LIMITER].lag.run(), name="loop-lag")
        discovery = asyncio.create_task(members.run(), name="discovery")
        yield
        await _stop(discovery)
        await _stop(probe)
        await _stop(task)
        await d.ahead.close()


def _log_death(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.critical("background task %s died: %r", task.get_name(), task.exception())


async def _stop(task: asyncio.Task[Any], timeout_s: float = 5.0) -> None:
    task.cancel()
    try:
        await asyncio.wait_for(task, timeout_s)
    except asyncio.CancelledError:
        pass
    except TimeoutError:
        log.error("task %s did not stop within %ss", task.get_name(), timeout_s)
