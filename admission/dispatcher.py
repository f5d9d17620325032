"""The dispatcher: admits queued requests onto nodes with room, in weighted-fair order.

It owns the sidecar's `FairQueue` and a view of every node (state published by the node agents
in Redis, plus what this sidecar admitted within `projection_window_s`: "projected usage"). A request
is dispatched when some node serving its model is open, below the hold watermark after
projection, and under its in-flight cap; the in-flight lease is then taken atomically in Redis
(lease.lua), so several sidecars never over-admit one node together.

Routing: among eligible nodes, the least loaded by max(projected memory / hold, in-flight / cap);
the next ones are the edge's fallbacks for a connect failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from admission import keys
from admission.errors import BackendUnavailable, QueueTimeout
from admission.limiter import REDIS_DOWN, Backlog, lease_release
from admission.metrics import Metrics
from admission.policy import Node, Policy
from admission.queue import FairQueue, Item
from admission.scripts import Call, Scripts
from admission.watermarks import DOWN, HOLD, MAINTENANCE, OPEN, STATES

log = logging.getLogger(__name__)

REFRESH_S = 0.1  # node-state poll period: a fraction of the agents' sample period
MAX_FALLBACKS = 2


@dataclass
class NodeView:
    node: Node
    state: str = DOWN
    memory: float = 0.0
    per_token: float = 0.0  # memory fraction one token of KV takes
    projected_tokens: int = 0  # admitted by this sidecar within the projection window
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (admitted at, tokens)
    inflight: int = 0
    waiting: int = 0

    def projected(self) -> float:
        return self.memory + self.projected_tokens * self.per_token

    def admitted(self, now: float, tokens: int) -> None:
        self.recent.append((now, tokens))
        self.projected_tokens += tokens

    def expire(self, before: float) -> None:
        """Admissions older than `before` are assumed to show in the node's samples by now."""
        while self.recent and self.recent[0][0] < before:
            self.projected_tokens -= self.recent.popleft()[1]

    def load(self, hold: float) -> float:
        return max(self.projected() / hold, self.inflight / self.node.max_inflight)


@dataclass(frozen=True)
class Admission:
    ticket: str
    node: str
    url: str
    fallbacks: list[tuple[str, str]]
    priority: int
    cls: str
    queued_s: float
    degraded: bool = False


@dataclass
class _Waiter:
    future: asyncio.Future[Admission] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


def new_request_id() -> str:
    return secrets.token_hex(8)


def make_ticket(rid: str, node: str, tenant: str) -> str:
    """Tickets carry request id, node and tenant, so any sidecar process can take the release."""
    return f"{rid}:{node}:{tenant}"


def parse_ticket(ticket: str) -> tuple[str, str, str]:
    """(request id, node, tenant) of a ticket; ValueError if it is not one of ours."""
    parts = ticket.split(":", 2)
    if len(parts) != 3 or not all(parts) or len(parts[0]) != 16:
        raise ValueError("malformed ticket")
    return parts[0], parts[1], parts[2]


class Dispatcher:
    def __init__(
        self,
        redis: Any,
        policy: Callable[[], Policy],
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        backlog: Backlog | None = None,
    ) -> None:
        self.backlog = backlog
        self.redis = redis
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.queue = FairQueue(policy())
        self.views: dict[str, NodeView] = {}
        self.scripts = Scripts(redis)
        self._wake = asyncio.Event()
        self._last_refresh_ok = clock()
        self.set_policy(policy())

    # -- policy ----------------------------------------------------------------------------
    def set_policy(self, policy: Policy) -> None:
        self.queue.set_policy(policy)
        old = self.views
        self.views = {}
        for nid, node in policy.nodes.items():
            v = old.get(nid)
            if v is None:
                v = NodeView(node)
            v.node = node
            self.views[nid] = v
        self._wake.set()

    # -- requests --------------------------------------------------------------------------
    def fast_path(self, model: str, cls: str | None = None) -> list[NodeView] | None:
        """Nodes to admit onto directly, when nobody is waiting (so no one is overtaken)."""
        if len(self.queue) == 0:
            return self.eligible_nodes(model, cls) or None
        return None

    def lease_call(self, node: Node, ticket: str) -> Call:
        ttl_us = int(self.policy().queue.lease_ttl_s * 1_000_000)
        return Call("lease", [keys.node_leases(node.id)], [node.max_inflight, ttl_us, ticket])

    def release_call(self, ticket: str) -> Call:
        """The lease release, to ride with the settle; updates this sidecar's view now."""
        _rid, node, _tenant = parse_ticket(ticket)
        v = self.views.get(node)
        if v is not None:
            v.inflight = max(0, v.inflight - 1)
        self._wake.set()
        return Call(None, [], ["ZREM", keys.node_leases(node), ticket])

    def lease_refused(self, view: NodeView) -> None:
        view.inflight = view.node.max_inflight  # another sidecar filled it

    async def submit(self, item: Item, fast: bool = True) -> Admission:
        """Queue `item` and wait for a node (or QueueFull now, or QueueTimeout at its deadline).

        Cancelling the caller (the client went away) removes the item from the queue, or
        releases its lease if it was admitted in the meantime.
        """
        if fast and (nodes := self.fast_path(item.model, item.requested_cls or item.cls)):
            # Fast path: nobody is waiting, so admitting directly overtakes no one and saves the
            # hop through the dispatcher task (most admissions when the cluster has room).
            adm = await self._admit(item, nodes)
            if adm is not None:
                return adm
        waiter = _Waiter()
        item.payload = waiter
        self.queue.push(item)
        self._gauge_depth()
        self._wake.set()
        timeout = max(0.0, item.deadline_at - self.clock())
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            self.queue.cancel(item)
            self._gauge_depth()
            if waiter.future.done():  # admitted at the very last moment
                return waiter.future.result()
            exc = QueueTimeout(
                self.clock() - item.enqueued_at, self.queue.retry_after(len(self.queue))
            )
            # A dispatch in flight for this item sees the settled future and gives its lease back.
            waiter.future.set_exception(exc)
            waiter.future.exception()  # mark retrieved
            raise exc from None
        except asyncio.CancelledError:
            self.queue.cancel(item)
            self._gauge_depth()
            if waiter.future.done():
                if not waiter.future.cancelled() and waiter.future.exception() is None:
                    await self.release_lease(waiter.future.result().ticket)
            else:
                waiter.future.cancel()
            raise

    async def release_lease(self, ticket: str) -> None:
        _rid, node, _tenant = parse_ticket(ticket)
        v = self.views.get(node)
        if v is not None:
            v.inflight = max(0, v.inflight - 1)
        try:
            await self.redis.zrem(keys.node_leases(node), ticket)
        except REDIS_DOWN:
            self.metrics.redis_errors.labels("release").inc()
            self._later(Call(None, [], ["ZREM", keys.node_leases(node), ticket]))
        self._wake.set()

    # -- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Refresh node views and dispatch, until cancelled."""
        next_refresh = 0.0
        while True:
            now = self.clock()
            if now >= next_refresh:
                await self.refresh()
                next_refresh = now + REFRESH_S
            started = time.process_time()
            await self.dispatch()
            self.metrics.dispatch_seconds.observe(time.process_time() - started)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), REFRESH_S)
            except TimeoutError:
                pass

    async def refresh(self) -> None:
        """Read every node's published state, admin flag and lease count from Redis."""
        views = list(self.views.values())
        pipe = self.redis.pipeline(transaction=False)
        for v in views:
            pipe.get(keys.node_state(v.node.id))
            pipe.get(keys.node_admin(v.node.id))
            pipe.zcard(keys.node_leases(v.node.id))
        try:
            res = await pipe.execute()
        except REDIS_DOWN:
            self.metrics.redis_errors.labels("refresh").inc()
            self._refresh_failed()
            return
        self._last_refresh_ok = self.clock()
        seen_by = self._last_refresh_ok - self.policy().watermarks.projection_window_s
        for i, v in enumerate(views):
            raw, admin, leases = res[3 * i], res[3 * i + 1], res[3 * i + 2]
            st = json.loads(raw) if raw else None
            if st is None:
                v.state = DOWN
            else:
                v.state = MAINTENANCE if admin else str(st.get("state", DOWN))
                v.memory = float(st.get("memory") or 0.0)
                v.per_token = float(st.get("per_token") or 0.0)
                v.waiting = int(st.get("waiting") or 0)
                v.expire(seen_by)
            v.inflight = int(leases)
        self._gauge_nodes()

    def _refresh_failed(self) -> None:
        if self.clock() - self._last_refresh_ok < self.policy().watermarks.stale_after_s:
            return  # keep the last view through a blip
        fail_open = self.policy().redis.failure_mode == "open"
        for v in self.views.values():
            if v.state != MAINTENANCE:
                v.state = OPEN if fail_open else DOWN

    def eligible_nodes(self, model: str, cls: str | None = None) -> list[NodeView]:
        """Nodes serving `model` that may take a request of class `cls` now, least loaded first.

        Open nodes below the hold watermark (after projection) take every class; a class with
        `admit_until: drain` is also admitted to held nodes, up to the drain watermark.
        """
        wm = self.policy().watermarks
        c = self.policy().classes.get(cls) if cls else None
        until_drain = c is not None and c.admit_until == "drain"
        limit = wm.drain if until_drain else wm.hold
        states = (OPEN, HOLD) if until_drain else (OPEN,)
        ok = [
            v
            for v in self.views.values()
            if model in v.node.models
            and v.state in states
            and v.projected() < limit
            and v.inflight < v.node.max_inflight
            and (until_drain or v.waiting < wm.max_engine_waiting)
        ]
        ok.sort(key=lambda v: (v.load(wm.hold), v.node.id))
        return ok

    def serves(self, model: str) -> bool:
        return any(model in n.models for n in self.policy().nodes.values())

    async def dispatch(self) -> int:
        """Admit as many queued requests as nodes have room for; return how many."""
        admitted = 0
        self.queue.age(self.clock())
        while True:
            # Memory rules follow the class a request asked for: aging moves it up the queue,
            # but does not let a long batch request use the headroom kept for realtime.
            item = self.queue.pop(
                self.clock(),
                lambda it: bool(self.eligible_nodes(it.model, it.requested_cls or it.cls)),
            )
            if item is None:
                break
            waiter: _Waiter = item.payload
            if waiter.future.done():  # the waiter gave up between pop and now
                continue
            nodes = self.eligible_nodes(item.model, item.requested_cls or item.cls)
            try:
                adm = await self._admit(item, nodes)
            except BackendUnavailable as exc:
                waiter.future.set_exception(exc)
                continue
            if adm is None:
                if not waiter.future.done():
                    self.queue.requeue_front(item)
                continue
            if waiter.future.done():  # timed out or cancelled while the lease was taken
                await self.release_lease(adm.ticket)
                continue
            waiter.future.set_result(adm)
            admitted += 1
        self._gauge_depth()
        return admitted

    async def _admit(self, item: Item, nodes: list[NodeView]) -> Admission | None:
        """Take a lease on the best node; None if another sidecar filled it meanwhile."""
        ticket = make_ticket(item.rid, nodes[0].node.id, item.tenant)
        if not await self._take_lease(nodes[0].node, ticket):
            self.lease_refused(nodes[0])
            return None
        return self.record_admission(item, nodes, ticket)

    def record_admission(self, item: Item, nodes: list[NodeView], ticket: str) -> Admission:
        """Account a lease taken on nodes[0] (projected usage, in-flight) and build the answer."""
        chosen = nodes[0]
        chosen.inflight += 1
        now = self.clock()
        chosen.admitted(now, item.cost)
        cls = self.policy().classes.get(item.cls)
        self.metrics.queue_wait_seconds.labels(item.cls).observe(now - item.enqueued_at)
        return Admission(
            ticket=ticket,
            node=chosen.node.id,
            url=chosen.node.url,
            fallbacks=[(v.node.id, v.node.url) for v in nodes[1 : 1 + MAX_FALLBACKS]],
            priority=cls.priority if cls else 0,
            cls=item.cls,
            queued_s=now - item.enqueued_at,
        )

    async def _take_lease(self, node: Node, ticket: str) -> bool:
        try:
            res = (await self.scripts.run(self.lease_call(node, ticket)))[0]
        except REDIS_DOWN as exc:
            self.metrics.redis_errors.labels("lease").inc()
            if self.policy().redis.failure_mode == "closed":
                self._later(lease_release(keys.node_leases(node.id), ticket))
                raise BackendUnavailable(
                    "lease store unavailable", code="limiter_unavailable"
                ) from exc
            return True  # fail-open: local in-flight counting only
        if isinstance(res, Exception):
            raise res
        return int(res[0]) == 1

    def _later(self, call: Call) -> None:
        """A lease release Redis did not take (or a lease that may have been taken): retried
        from the limiter's backlog; without one, the lease TTL frees it."""
        if self.backlog is not None:
            self.backlog.add(call)

    # -- admin -----------------------------------------------------------------------------
    async def set_maintenance(self, node: str, on: bool) -> None:
        if on:
            await self.redis.set(keys.node_admin(node), "drain")
        else:
            await self.redis.delete(keys.node_admin(node))
        await self.refresh()
        self._wake.set()

    def snapshot(self) -> list[dict[str, Any]]:
        hold = self.policy().watermarks.hold
        return [
            {
                "node": v.node.id,
                "url": v.node.url,
                "models": list(v.node.models),
                "state": v.state,
                "memory": round(v.memory, 4),
                "projected_memory": round(v.projected(), 4),
                "inflight": v.inflight,
                "max_inflight": v.node.max_inflight,
                "waiting": v.waiting,
                "load": round(v.load(hold), 4),
            }
            for v in self.views.values()
        ]

    def _gauge_depth(self) -> None:
        for name in self.policy().classes:
            self.metrics.queue_depth.labels(name).set(self.queue.depth(name))

    def _gauge_nodes(self) -> None:
        for v in self.views.values():
            for s in STATES:
                self.metrics.node_state.labels(v.node.id, s).set(1 if v.state == s else 0)
            self.metrics.node_memory.labels(v.node.id).set(v.projected())
            self.metrics.node_inflight.labels(v.node.id).set(v.inflight)
