"""Placing a request on the node routing chose: take its lease in the node's ledger
(lease.lua), account it in this sidecar's view, build the answer for the edge; give a lease
back. The dispatcher decides who goes and where; this module does the taking and undoing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from admission.errors import BackendUnavailable
from admission.loop_lag import LoopLag
from admission.metrics import Metrics
from admission.policy import FailureMode, Policy
from admission.scheduling import leases
from admission.scheduling.ask import Ask
from admission.scheduling.nodetable import NodeTable
from admission.scheduling.priority import engine_priority
from admission.scheduling.queue import Item
from admission.scheduling.shedding import FairShed
from admission.scheduling.ticket import make_ticket, parse_ticket
from admission.scheduling.views import NodeView
from admission.store import REDIS_DOWN, Call, PoolBusy, Store, dropped, keys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admission:
    ticket: str
    node: str
    url: str
    fallbacks: list[tuple[str, str]]
    priority: int
    cls: str
    queued_s: float


LATE_WAIT_S = 15.0  # a lease our late loop timed out is asked again for this long (as the
# limiter waits in line for a busy pool), then refused sidecar_overloaded


class Placer:
    """Takes and gives back node leases for the dispatcher, and keeps the views in step."""

    def __init__(
        self,
        st: Store,
        policy: Callable[[], Policy],
        metrics: Metrics,
        nodes: NodeTable,
        clock: Callable[[], float],
        wake: asyncio.Event,
    ) -> None:
        self.store = st
        self.policy = policy
        self.metrics = metrics
        self.nodes = nodes
        self.clock = clock
        self.wake = wake  # the dispatcher loop's: a freed slot may admit a queued request
        self.active = False  # an admission or release since the dispatcher's last node poll
        self.lag = LoopLag()  # the limiter's (Dispatcher): a late loop is not an outage
        self.shed = FairShed()  # past capacity, refusals by tenant weight (shedding.py)

    async def lease(self, item: Item, nodes: list[tuple[NodeView, Ask]]) -> Admission | None:
        """Take a lease on the best node; None if its ledger refused (another sidecar booked)."""
        node, ask = nodes[0]
        ticket = make_ticket(item.rid, node.node.id, item.tenant)
        call = leases.take(node.node, ticket, self.policy().queue.lease_ttl_s, ask)
        late_until, again, resent = self.clock() + LATE_WAIT_S, True, False

        def orphan() -> tuple[Call, ...]:  # the request left while its lease was out
            return (leases.give_back(ticket, released=True),)

        while True:
            try:
                res = (await self.store.scripts.run(call, orphan=orphan))[0]
                break
            except PoolBusy:  # our own pool is full: the item goes back to the head of its lane
                if self.store.scripts.cluster:  # a re-send found it full: the first may have run
                    item.stale += (ticket,)
                return None
            except REDIS_DOWN as exc:
                if again and dropped(exc):  # asked again at once (lease.lua is idempotent)
                    again, resent = False, True
                    self.metrics.redis_errors.labels("dropped").inc()
                    continue
                self.metrics.redis_errors.labels("lease").inc()
                late = await self.lag.after_timeout(self.metrics, "lease", late_until, self.clock())
                if late == "again":  # our own lateness timed it out: not an outage
                    resent = True
                    continue
                if late == "refuse":
                    self.store.backlog.add(leases.give_back(ticket, final=True))  # may run late
                    raise self.lag.refusal() from exc
                if self.policy().redis.failure_mode == FailureMode.CLOSED:
                    self.store.backlog.add(leases.give_back(ticket, final=True))  # may run late
                    raise BackendUnavailable(
                        "lease store unavailable", code="limiter_unavailable"
                    ) from exc
                return self.record(item, nodes, ticket)  # fail-open: local accounting only
        if isinstance(res, Exception):
            raise res
        if not leases.granted(res):
            self.refused(node, res)
            if resent:  # an earlier copy may book it yet: the request's end gives it back
                item.stale += (ticket,)
            return None
        adm = self.record(item, nodes, ticket, res)
        node.seen(leases.figures(res), self.clock())
        return adm

    def refused(self, node: NodeView, res: Any) -> None:
        """The ledger said no: take its figures, so that the next pass sees the node as full."""
        r = leases.refusal(res)
        if r is None:
            return
        reason, pending, kv = r
        node.ledger(pending, kv, node.inflight, self.clock())
        if reason == "inflight":
            node.inflight = node.node.max_inflight

    def record(
        self, item: Item, nodes: list[tuple[NodeView, Ask]], ticket: str, res: Any = None
    ) -> Admission:
        """Account a lease taken on the first node (`res`: lease.lua's reply, if any); build
        the answer."""
        self.active = True
        chosen, ask = nodes[0]
        now = self.clock()
        chosen.booked(ask, now)
        self.nodes.touch(chosen.node.id)
        cls = item.requested_cls or item.cls
        self.nodes.shares.served(item.model, cls, item.tenant, item.cost)
        self.shed.admitted(item.model, cls, item.cost, now)
        self.nodes.prefix_booked(ticket, chosen, ask, res)
        self.nodes.answers.admitted(ticket, ask.urgent, item.model, cls, item.tenant)
        self.metrics.queue_wait_seconds.labels(item.cls).observe(now - item.enqueued_at)
        return Admission(
            ticket=ticket,
            node=chosen.node.id,
            url=chosen.node.url,
            fallbacks=self.nodes.fallbacks([v for v, _a in nodes], item.model, item.tenant),
            priority=engine_priority(
                self.policy(),
                item.requested_cls,
                item.cls,
                item.tenant,
                chosen.node,
                ask.prompt_tokens,
                ask.prefill_tokens,
            ),
            cls=item.cls,
            queued_s=now - item.enqueued_at,
        )

    def forget(self, item: Item, keep: str = "") -> None:
        """Give back for good, but `keep`, the tickets a late copy of `item`'s lease may still
        book (`Item.stale`): the request ended on another ticket, or on none."""
        for t in item.stale:
            if t != keep:
                self.store.backlog.add(leases.give_back(t, final=True))
        item.stale = ()

    async def give_back(self, ticket: str) -> None:
        """Give back a lease granted to a request that will not run on it (refused, timed out,
        gone, or asked again elsewhere): for good (`leases.give_back`'s `final`)."""
        _rid, node, _tenant = parse_ticket(ticket)
        self.freed(node)
        call = leases.give_back(ticket, final=True)
        try:
            (out,) = await self.store.scripts.run(call)
            leases.given_back(ticket, out)
        except REDIS_DOWN:
            self.metrics.redis_errors.labels("release").inc()
            self.store.backlog.add(call)

    async def drop_stale(self, ticket: str, model: str) -> None:
        """`ticket` placed a request asked again: a lease of the same request on another node
        of the model (its lost first sidecar took it, and no release will come for it) goes
        back — its node part only: the reservation is the live request's."""
        rid, keep, tenant = parse_ticket(ticket)
        nodes = [n for n, v in self.nodes.views.items() if n != keep and model in v.node.models]
        others = [make_ticket(rid, n, tenant, ahead) for n in nodes for ahead in (False, True)]
        try:
            pipe = self.store.redis.pipeline(transaction=False)
            for t in others:
                pipe.zscore(keys.node_leases(parse_ticket(t)[1]), t)
            found = [t for t, at in zip(others, await pipe.execute(), strict=True) if at]
        except REDIS_DOWN:
            return  # they expire at lease_ttl_s
        for t in found:
            log.warning("request %s asked again: its lease %s on another node given back", rid, t)
            await self.give_back(t)

    def freed(self, node: str) -> None:
        self.active = True
        self.nodes.touch(node)
        if (v := self.nodes.get(node)) is not None:
            v.inflight = max(0, v.inflight - 1)
        self.wake.set()
