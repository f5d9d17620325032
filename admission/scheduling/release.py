"""Releases: a request ended; give its node lease back and settle what the tenant owes.

The edge sends them in batches (admission/edge/release.lua), settled in one Redis round round_trip.
What each release teaches the sidecar is taken first: the urgent class's answer lengths (the
decode guard), the engine's count of cached prompt tokens beside the prefix index's guess, and
whether the edge could reach the node at all (ejection).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from admission.limits.buckets import Limiter, Settling
from admission.policy import Policy
from admission.scheduling import leases, round_trip
from admission.scheduling.answer_ahead import Ahead
from admission.scheduling.nodetable import NodeTable
from admission.scheduling.take_lease import Placer
from admission.scheduling.ticket import answered_ahead, parse_ticket
from admission.store import Call

# (ticket, tokens to charge (-1: the reservation), node unreachable, output tokens (-1: unknown),
# cached prompt tokens the engine reported (-1: unknown))
Released = tuple[str, int, bool, int, int]


@dataclass
class Releases:
    """Settles releases, given what it uses: the policy, the bookings answered ahead (a
    release waits for its booking), the node table (what releases teach), the limiter and the
    placer (a freed node wakes the queue)."""

    policy: Callable[[], Policy]
    ahead: Ahead
    nodes: NodeTable
    limiter: Limiter
    place: Placer

    async def settle(
        self,
        entries: list[Released],
        names: list[tuple[str, str] | None] | None = None,
        finishes: list[str | None] | None = None,
    ) -> list[int]:
        """Settle a batch of releases in one round trip; the tokens refunded to each. `names`:
        each release's (model, class) as the edge sent them (None: not sent), from which a
        sidecar learns the answers of requests another one admitted; `finishes`: how each
        answer ended (only one that ended on its own teaches a length)."""
        items: list[Settling] = []
        backs: list[Call] = []
        policy = self.policy()
        nodes, tenants = [], policy.tenants
        await self.ahead.settled(ticket for ticket, *_rest in entries)  # booked before released
        for i, (ticket, actual, failed, out, cached) in enumerate(entries):
            rid, node, tid = parse_ticket(ticket)
            named = names[i] if names else None
            elsewhere = None
            if named is not None and named[1] in policy.classes:
                elsewhere = (policy.is_urgent(named[1]), (named[0], named[1], tid))
            finish = finishes[i] if finishes else None
            self.nodes.answers.answered(ticket, out, elsewhere, finish)
            unconfirmed = self.nodes.placements.engine_cached(ticket, cached)
            await self.nodes.proxied(node, failed, ticket)
            first = answered_ahead(ticket)  # its release may come before its booking
            items.append((tenants.get(tid), rid, actual, first))
            # Released (it ended): so may any lease's, whose reply the sidecar timed out on and
            # ran the request without — Redis may run that booking after this (a lease left to
            # its TTL: tests/test_many_sidecars.py, now and then on a loaded machine).
            backs.append(
                leases.give_back(ticket, released=True, ran=not failed, confirmed=not unconfirmed)
            )
            nodes.append(node)
        try:
            return await round_trip.settle(self.limiter, items, backs)
        finally:
            for node in nodes:  # only now are the leases gone in Redis (waking earlier requeued)
                self.place.freed(node)
