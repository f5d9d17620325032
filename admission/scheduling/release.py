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
from admission.usage import Release


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

    async def settle(self, entries: list[Release]) -> list[int]:
        """Settle a batch of releases in one round trip; the tokens refunded to each. A
        release's `names` teach a sidecar the answers of requests another one admitted; its
        `finish`, whether the answer ended on its own (only that teaches a length)."""
        items: list[Settling] = []
        backs: list[Call] = []
        policy = self.policy()
        nodes, tenants = [], policy.tenants
        await self.ahead.settled(r.ticket for r in entries)  # booked before released
        for r in entries:
            ticket, failed = r.ticket, r.node_failed
            rid, node, tid = parse_ticket(ticket)
            named, elsewhere = r.names, None
            if named is not None and named[1] in policy.classes:
                elsewhere = (policy.is_urgent(named[1]), (named[0], named[1], tid))
            self.nodes.answers.answered(ticket, r.output_tokens, elsewhere, r.finish)
            unconfirmed = self.nodes.placements.engine_cached(ticket, r.cached_tokens)
            await self.nodes.proxied(node, failed, ticket)
            first = answered_ahead(ticket)  # its release may come before its booking
            items.append((tenants.get(tid), rid, r.tokens, first))
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
