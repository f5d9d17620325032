"""Answering ahead of the round trip: the fast path without Redis on the edge's clock.

A fast-path admission costs one Redis round trip (the tenant's buckets and the node lease,
together); on a busy 2-core box that round trip is most of what the admission hop adds
(docs/benchmarks.md). When this sidecar's last figures show room for *twice* what it would then
have let through ahead and not yet seen booked (this request included) — the tenant's levels,
concurrency and burst window in the last reply from Redis (at most `ROOM_FRESH_S` old), and the
node's view (refreshed at least every 0.2 s while requests flow, and from every lease reply) —
the answer goes back at once and the same round trip follows, *forced*: Redis books the request
whatever it finds, so its ledger and buckets hold what really runs. A forced booking that went
past a limit (another sidecar took the room meanwhile) is counted in
`admission_ahead_total{result}` and is paid back like any debt: the bucket goes below zero, the
node's ledger shows the overshoot and the next decisions see it. The margin makes that rare,
not impossible: this sidecar's view does not hold what other sidecars booked through Redis
since it was read (≤ 0.2 s, less under load: every lease reply refreshes it), which is why a
node is only answered ahead in the lower half of its in-flight cap. (A first rule, "room for
one more", let two sidecar processes put 9 requests on a node capped at 5; "twice what it has
out" alone still let 7 through now and then, a stale view against the other sidecar's waited
admissions.) A release waits for its request's booking, so Redis never sees the release first.

A request asked again (its sidecar died; the edge re-asks another with the same request id) is
charged once all the same: acquire.lua's check for an existing reservation comes before any
limit, forced or not, and the lease of the same ticket replaces its booking.

Never ahead: a tenant in shadow mode, a node lent by another pool, a Redis that failed within
the last second, or with `redis.answer_ahead: false` (every admission waits for Redis).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from admission.limits import Acquired, Limiter
from admission.metrics import Metrics
from admission.policy import Policy, Tenant
from admission.scheduling import leases
from admission.scheduling.ask import Ask
from admission.scheduling.gates import why_not
from admission.scheduling.views import NodeView
from admission.store import Backlog

log = logging.getLogger(__name__)

# Bookings out at once per sidecar process, beyond which admissions wait for Redis again. The
# waited round trip is the sidecar's backpressure: without it, 1,024 closed-loop clients had
# thousands of bookings queued behind one another, past redis.command_timeout_ms (fail-open).
MAX_OUT = 32


def room_for_twice(
    v: NodeView, ask: Ask, policy: Policy, cls: str, now: float, out: int = 0
) -> bool:
    """Whether the node, as this sidecar sees it (its `out` bookings still on their way
    included), would take this request and as much again as this sidecar has then let through
    ahead (`out` + 1 more such requests), and stay in the lower half of its in-flight cap: what
    other sidecars booked through Redis since this view was read is not in it."""
    m = out + 2
    if 2 * (v.inflight + m) > v.node.max_inflight:
        return False
    more = dataclasses.replace(
        ask, prompt_tokens=m * ask.prompt_tokens, kv_tokens=m * ask.kv_tokens
    )
    return why_not(v, more, policy, cls, now) is None


class Ahead:
    """The forced round trips of requests answered ahead, until Redis has booked them."""

    def __init__(
        self, limiter: Limiter, backlog: Backlog, metrics: Metrics, clock: Callable[[], float]
    ) -> None:
        self.limiter, self.backlog, self.metrics, self.clock = limiter, backlog, metrics, clock
        self._out: dict[str, asyncio.Task[None]] = {}  # ticket → its booking
        self._on_node: dict[str, int] = {}  # node → bookings out (`room_for_twice` counts them)

    def may(
        self,
        policy: Policy,
        tenant: Tenant,
        cls: str,
        tokens: int,
        v: NodeView,
        ask: Ask,
        now: float,
    ) -> bool:
        """Whether this fast-path admission may be answered before Redis books it: the node
        and the tenant have room for twice what this sidecar would then have out (see
        `room_for_twice`, `Limiter.room_ahead`)."""
        lent = v.node.pool is not None and policy.tenant_pool.get(tenant.id) != v.node.pool
        return (
            policy.redis.answer_ahead
            and len(self._out) < MAX_OUT
            and not tenant.shadow
            and not lent
            and self.limiter.room_ahead(tenant, tokens)
            and room_for_twice(v, ask, policy, cls, now, self._on_node.get(v.node.id, 0))
        )

    def book(self, ticket: str, v: NodeView, booking: Awaitable[tuple[Acquired, Any]]) -> None:
        """Run the forced round trip of a request answered ahead onto `v` (`booking`:
        `trip.forced`, the tenant's debit with the forced lease)."""
        node = v.node.id
        self._on_node[node] = self._on_node.get(node, 0) + 1

        def done(_t: object) -> None:
            self._out.pop(ticket, None)
            if (left := self._on_node.pop(node, 1) - 1) > 0:
                self._on_node[node] = left

        task = asyncio.ensure_future(self._booked(ticket, v, booking))
        self._out[ticket] = task
        task.add_done_callback(done)

    async def settled(self, tickets: Iterable[str]) -> None:
        """Wait until the bookings of these tickets (if still out) are done."""
        out = [t for k in tickets if (t := self._out.get(k)) is not None]
        if out:
            await asyncio.wait(out)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Let the bookings still out finish (shutdown: before the Redis client closes)."""
        if self._out:
            await asyncio.wait(list(self._out.values()), timeout=timeout_s)

    async def _booked(
        self, ticket: str, v: NodeView, booking: Awaitable[tuple[Acquired, Any]]
    ) -> None:
        try:
            acq, got = await booking
        except Exception:  # a script error: the request runs; free what may have been booked
            log.exception("booking of a request answered ahead failed")
            acq, got = Acquired("redis"), None
        if acq.mode != "redis" or acq.denied is not None or got is None:
            # Redis failed (fail-open then charged the local buckets) or the pool was busy:
            # the request runs without a booking; the lease, which may have run, goes back.
            result = "unconfirmed"
            if got is None:
                self.backlog.add(leases.give_back(ticket, released=True))
        elif acq.over:
            result = "over_limits"
        elif leases.over(got) not in ("", "released"):  # released: ended before booked
            result = "over_node"
        else:
            result = "confirmed"
        if result != "unconfirmed":
            v.seen(leases.figures(got), self.clock())
        self.metrics.ahead_by[result].inc()
