"""The dispatcher: owns the whole admission decision, from the limits to the node lease.

`admit` is the one place that decides:
1. fast path: when nobody waits (so no one is overtaken) and a node has room, the node lease
   rides in the same Redis round trip as the tenant's buckets — answered ahead of that round
   trip when the last figures show room for twice what this sidecar has out (answer_ahead.py);
2. otherwise the request joins the `FairQueue`, and the dispatcher loop admits it when some
   node serving its model is open, below its watermark after projection and under its
   in-flight cap (lease.lua takes the lease atomically across sidecars).
It undoes what it took and did not use (a lease, an unused reservation); nobody else does.
Order: the fair queue decides who is next; `on_late: refuse` classes are refused (429
`slo_unreachable`) once waiting longer cannot meet their TTFT target, 503 `no_capacity` when no
node of the model is left. Routing: routing.py; the next nodes are the edge's fallbacks.

One job over 350 lines: the admit decision and every undo of it stay in one place (who
undoes what: docs/decisions/2026-12-07-who-undoes.md); the loop, the lease, the release
settle and the rules are collaborators given what they use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from admission.errors import (
    AdmissionError,
    BackendUnavailable,
    NoCapacity,
    OverFairShare,
    QueueTimeout,
    SloUnreachable,
)
from admission.limits import Limiter, shadow
from admission.metrics import Metrics
from admission.policy import Policy, Tenant
from admission.scheduling import leases, round_trip
from admission.scheduling.answer_ahead import Ahead
from admission.scheduling.ask import Ask, Request
from admission.scheduling.demand import DemandSignal
from admission.scheduling.late_heads import late_heads
from admission.scheduling.nodetable import NodeTable
from admission.scheduling.overload import Overload, State
from admission.scheduling.prefixes import NO_PREFIX, Prefix
from admission.scheduling.queue import FairQueue, Item
from admission.scheduling.release import Releases
from admission.scheduling.running import REFRESH_S, Loop
from admission.scheduling.take_lease import Admission, Placer
from admission.scheduling.ticket import make_ticket, new_request_id
from admission.scheduling.views import NodeView
from admission.store import Store
from admission.usage import Release

log = logging.getLogger(__name__)


@dataclass
class _Waiter:
    future: asyncio.Future[Admission] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Dispatcher:
    def __init__(
        self,
        st: Store,
        limiter: Limiter,
        policy: Callable[[], Policy],
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.limiter, self.policy, self.metrics = st, limiter, policy, metrics
        self.clock = clock
        self.queue = FairQueue(policy())
        answered = st.scripts
        self.nodes = NodeTable(
            st.redis, policy, metrics, clock, lambda: time.monotonic() - answered.answered_at
        )
        metrics.views_age.set_function(self.nodes.views_age)
        self.wake = asyncio.Event()
        self.ahead = Ahead(limiter, st.backlog, metrics, clock)
        self.place = Placer(st, policy, metrics, self.nodes, clock, self.wake)
        self.overload = Overload()  # when a (model, class) is past capacity (overload.py)
        self.nodes.lag = self.place.lag = limiter.lag  # one probe: the server's loop
        self.nodes.shares.waiting = self.queue.waiting_tenants
        # What an autoscaler reads (demand.py): published after each refresh.
        self.demand = DemandSignal(
            policy, lambda: self.nodes.views.values(), self.queue, metrics, clock
        )
        self.releases = Releases(policy, self.ahead, self.nodes, limiter, self.place)
        self.loop = Loop(
            clock, metrics, self.nodes, self.place, self.queue, self.dispatch, self.wake
        )

    def set_policy(self, policy: Policy) -> None:
        self.queue.set_policy(policy)
        self.nodes.set_policy(policy)
        self.wake.set()

    # -- the decision ------------------------------------------------------------------------
    async def admit(
        self,
        tenant: Tenant,
        cls: str,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        waited_s: float = 0.0,
        rid: str | None = None,
        prefix: Prefix = NO_PREFIX,
    ) -> Admission:
        """Charge the tenant's limits and get a node, now or from the queue.

        Raises Throttled / RequestTooLarge (limits), QueueFull, QueueTimeout,
        BackendUnavailable (fail-closed); in every case nothing stays taken. `waited_s`: how
        long the request already waited elsewhere (re-asked after its sidecar died): it keeps
        that deadline spent and aging credit; its `rid` is charged once (idempotent acquire).
        `prefix`: the prompt's head (routing prefers where it is cached; it is booked once per node).
        """
        policy = self.policy()
        cost = prompt_tokens + max_tokens  # what the tenant's limits reserve (settled at release)
        # What the node books and fairness counts: the prompt and the answer as long as the
        # tenant's answers of the class run (AnswerLengths.answer_kv), at most max_tokens — a
        # tenant sending a generous cap is neither booked nor charged its turn for tokens it
        # never gets.
        expected = prompt_tokens + self.nodes.answers.answer_kv(model, cls, tenant.id, max_tokens)
        rid = rid or new_request_id()
        self._shed(policy, tenant, cls, model, expected)
        await self.nodes.fresh(2 * REFRESH_S)  # after a quiet spell; busy, the loop polls
        arrived = self.clock() - waited_s  # (re-asked: when it first arrived elsewhere)
        deadline = arrived + policy.classes[cls].deadline_s
        item = Item(tenant.id, cls, expected, model, arrived, deadline, rid=rid, asked=cost)
        item.prompt, item.prefix = prompt_tokens, prefix
        nodes = self._fast_path(item)
        if not nodes:
            self.overload.no_node(model, cls, self.clock())
        return await self._take(policy, tenant, item, nodes)

    async def _take(
        self, policy: Policy, tenant: Tenant, item: Item, nodes: list[tuple[NodeView, Ask]] | None
    ) -> Admission:
        """Debit the tenant's limits with the first node's lease in one round trip (answered
        ahead of it when `Ahead.may`), or queue `item` when no node took it."""
        rid, cost, cls, ttl_s = item.rid, item.asked, item.cls, policy.queue.lease_ttl_s
        lease = ticket = None
        # The reservation and the concurrency slot must outlive the wait in the queue as well
        # as the run: they expire after the class deadline plus the longest run.
        hold_s = ttl_s + policy.classes[cls].deadline_s
        scale = self.nodes.pressure.limit_factor(item.model, cls)  # memory-aware limits
        if nodes:
            (view, ask), now = nodes[0], self.clock()
            ahead = self.ahead.may(policy, tenant, cls, cost, view, ask, now)
            ticket = make_ticket(rid, view.node.id, tenant.id, ahead)
            if ahead:
                forced = leases.take(view.node, ticket, ttl_s, ask, force=True)
                booking = round_trip.forced(
                    self.limiter, tenant, rid, cost, hold_s, scale, forced, ticket
                )
                self.ahead.book(ticket, view, booking)
                self.queue.charge(item)
                return self.place.record(item, nodes, ticket)
            lease = leases.take(view.node, ticket, ttl_s, ask)
        resent: list[bool] = []
        args = (self.limiter, tenant, rid, cost, hold_s, scale, lease, ticket)
        acq, got = await round_trip.debit(*args, resent=lambda: resent.append(True))
        held = lease is not None and leases.granted(got)
        if ticket is not None and not held and (got is None or resent):
            # Not held, but booked maybe: the round trip failed (it may have run), or it was
            # refused after a re-send (an earlier copy may book it yet). Given back for good
            # when the request ends, unless it ends holding that very ticket.
            item.stale += (ticket,)
        adm: Admission | None = None
        try:
            if not shadow.let_through(tenant, acq.denied, self.metrics):
                if held and ticket is not None:
                    await self.place.give_back(ticket)
                assert acq.denied is not None  # let_through says no only with a reason
                raise acq.denied
            if held and nodes and ticket is not None:
                self.queue.charge(item)
                adm = self.place.record(item, nodes, ticket, got)
                return adm
            if nodes and got is not None:
                self.place.refused(nodes[0][0], got)
            try:
                adm = await self.submit(item)
                return adm
            except (AdmissionError, asyncio.CancelledError):
                # Nothing ran: refund the whole reservation and free the concurrency slot.
                await self.limiter.settle(tenant, rid, 0)
                raise
        finally:
            self.place.forget(item, adm.ticket if adm is not None else "")

    def _shed(self, policy: Policy, tenant: Tenant, cls: str, model: str, cost: int) -> None:
        """Raise OverFairShare if the class is SHEDDING (overload.py) and this tenant asks
        more than its weight's share (shedding.py); nothing is taken yet."""
        if not policy.classes[cls].refuses_late:
            return
        now = self.clock()
        past = self.overload.state(model, cls, now) == State.SHEDDING
        if self.place.shed.arrive(model, cls, tenant.id, cost, now, policy.weight_of, past):
            self.metrics.fair_shed.labels(cls).inc()
            self.overload.refused_late(model, cls, now)  # still past capacity
            raise OverFairShare(cls, self.queue.retry_after(len(self.queue)))

    async def release(self, ticket: str, actual: int, failed: bool = False, **kw: Any) -> int:
        """One release; `kw`: out, cached (-1: unknown), finish ("stop")."""
        out, cached, finish = kw.get("out", -1), kw.get("cached", -1), kw.get("finish", "stop")
        one = Release(ticket, actual, failed, out, cached, finish=finish)
        return (await self.release_many([one]))[0]

    async def release_many(self, entries: list[Release]) -> list[int]:
        """Give leases back and settle (tokens refunded to each), in one round trip."""
        return await self.releases.settle(entries)

    # -- the queue ---------------------------------------------------------------------------
    def _fast_path(self, item: Item) -> list[tuple[NodeView, Ask]] | None:
        """Nodes to admit `item` onto directly, when no request of its class or a more urgent
        one waits (so no one who would go first is overtaken): under overload, realtime keeps
        its fast path while batch queues."""
        if self.queue.waiting_at_or_above(item.requested_cls or item.cls):
            return None
        nodes = self._eligible(item)
        if nodes and not self._fair(item, len(nodes)):
            return None  # a tenant waiting on another sidecar is owed the next slot
        return nodes or None

    def _fair(self, it: Item, room: int) -> bool:
        """Whether `it` may take a node now, tenant weights counted across sidecars (shares.py);
        held back at most `shares.HOLD_MAX_S` in all. `room`: the nodes found with room for it."""
        cls = it.requested_cls or it.cls
        mine = self.queue.waiting_in(it.model, cls)
        now = self.clock()
        held_s = now - it.held_at if it.held_at else 0.0
        if self.nodes.shares.may_take(it.model, cls, it.tenant, it.cost, held_s, mine, room):
            return True
        it.held_at = it.held_at or now
        return False

    def _eligible(self, it: Item) -> list[tuple[NodeView, Ask]]:
        """Nodes that would take `it` now, best first. Memory and prefill rules follow the class
        a request asked for: aging moves it up the queue, but does not let a long batch request
        use what is kept for realtime."""
        q, cls, now = self.queue, it.requested_cls or it.cls, self.clock()
        late = self.overload.late(it.model, cls, now)
        # The wait counts only while the class is late (routing.eligible): 0 otherwise, so
        # that routing keeps this Request as it is.
        waited = now - it.enqueued_at if late else 0.0
        req = Request(it.model, cls, it.prompt, it.cost, it.tenant, it.prefix, waited)
        owed = self.overload.owed(self.policy(), it.model, cls, now, self.place.shed.class_share)
        return self.nodes.eligible(req, q.tenant_depth, q.waiting_kv, owed, late)

    def owed(self, model: str, cls: str) -> bool:
        """Whether the decode guard lets `cls` through for `model` now (Overload.owed): an urgent
        class is late and this sidecar admitted `cls` under its `min_share` lately."""
        now, share = self.clock(), self.place.shed.class_share
        return self.overload.owed(self.policy(), model, cls, now, share)

    async def submit(self, item: Item) -> Admission:
        """Queue `item` and wait for a node (or QueueFull now, or QueueTimeout at its deadline).

        Cancelling the caller (the client went away) removes the item from the queue, or
        releases its lease if it was admitted in the meantime.
        """
        if nodes := self._fast_path(item):
            # Nobody is waiting, so admitting directly overtakes no one and saves the hop
            # through the dispatcher task.
            adm = await self.place.lease(item, nodes)
            if adm is not None:
                self.queue.charge(item)
                return adm
        waiter = _Waiter()
        item.payload = waiter
        self.queue.push(item)
        self._gauge_depth()
        self.wake.set()
        timeout = max(0.0, item.deadline_at - self.clock())
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            self.queue.cancel(item)
            self._gauge_depth()
            if waiter.future.done():  # admitted at the very last moment
                return waiter.future.result()
            waited_s, retry_s = (
                self.clock() - item.enqueued_at,
                self.queue.retry_after(len(self.queue)),
            )
            exc = self._no_capacity(item) or QueueTimeout(waited_s, retry_s)
            # A dispatch in flight for this item sees the settled future and gives its lease back.
            waiter.future.set_exception(exc)
            waiter.future.exception()  # mark retrieved
            raise exc from None
        except asyncio.CancelledError:
            self.queue.cancel(item)
            self._gauge_depth()
            if waiter.future.done():
                if not waiter.future.cancelled() and waiter.future.exception() is None:
                    await self.place.give_back(waiter.future.result().ticket)
            else:
                waiter.future.cancel()
            raise

    # -- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Read node views and dispatch the queue, until cancelled (running.py)."""
        await self.loop.run()

    async def dispatch(self) -> int:
        """Admit as many queued requests as nodes have room for; return how many."""
        admitted = 0
        now = self.clock()
        self.queue.age(now)
        self._refuse_late(now)

        found: list[tuple[NodeView, Ask]] = []

        def runnable(it: Item) -> bool:
            # The nodes found for the item popped are kept: routing runs once per decision.
            found[:] = self._eligible(it)
            return bool(found) and self._fair(it, len(found))

        while True:
            item = self.queue.pop(self.clock(), runnable)
            if item is None:
                break
            waiter: _Waiter = item.payload
            if waiter.future.done():  # the waiter gave up between pop and now
                continue
            try:
                adm = await self.place.lease(item, list(found))
            except BackendUnavailable as exc:
                waiter.future.set_exception(exc)
                continue
            if waiter.future.done():  # timed out or cancelled while the lease was asked for
                self.place.forget(item)  # (admit has already given back what it knew)
                if adm is not None:
                    await self.place.give_back(adm.ticket)
                continue
            if adm is None:
                self.queue.requeue_front(item)
                continue
            waiter.future.set_result(adm)
            admitted += 1
        self._gauge_depth()
        return admitted

    def _refuse_late(self, now: float) -> None:
        cached = self.nodes.cached
        over = self.overload
        heads = late_heads(self.policy(), self.queue, self.nodes.near, now, cached, over)
        for name, item in heads:
            waiter: _Waiter = item.payload
            if not waiter.future.done():
                # No node left for the model: not overload (no late refusal to learn from).
                if none := self._no_capacity(item):
                    waiter.future.set_exception(none)
                    continue
                waiter.future.set_exception(
                    SloUnreachable(name, self.queue.retry_after(len(self.queue)))
                )
                waiter.future.exception()  # retrieved by submit
                self.metrics.late_refused.labels(name).inc()
                over.refused_late(item.model, name, now)

    def _no_capacity(self, item: Item) -> NoCapacity | None:
        """What a queued request is told when no node of its model is left to serve it."""
        return NoCapacity(item.model) if self.nodes.live.get(item.model) == 0 else None

    # -- admin and gauges --------------------------------------------------------------------
    async def set_maintenance(self, node: str, on: bool) -> None:
        await self.nodes.set_maintenance(node, on)
        self.wake.set()

    views = property(lambda self: list(self.nodes.views.values()))

    def _gauge_depth(self) -> None:
        for name in self.policy().classes:
            self.metrics.queue_depth.labels(name).set(self.queue.depth(name))
