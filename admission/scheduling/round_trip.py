"""The dispatcher's Redis round trips: the tenant's debit and settlement (the limiter's calls)
with the node lease and its release (ours) in the same round trip, each side undoing its own.

The limiter knows nothing of leases (admission/limits/buckets.py): it builds its calls, runs a
round trip under its failure mode, and reads its own replies. Here the two are put together: a
fast-path admission is one round trip, a batch of releases another.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from admission.limits import Acquired, Limiter
from admission.limits.buckets import Settling
from admission.policy import Tenant
from admission.scheduling import leases
from admission.store import Call


async def debit(
    limiter: Limiter,
    tenant: Tenant,
    rid: str,
    tokens: int,
    hold_s: float,
    scale: float = 1.0,
    lease: Call | None = None,
    ticket: str | None = None,
    force: bool = False,
    resent: Callable[[], None] | None = None,
) -> tuple[Acquired, Any]:
    """Debit the tenant and take `lease` (of `ticket`) in one round trip. Returns what the
    limiter decided and lease.lua's reply — None when no lease rode, or when the round trip
    failed and *may have run*: then the lease is the caller's to give back, unless it ends up
    holding that very ticket. A caller cancelled while the round trip is out gets both undone.
    `resent`: called if the round trip was sent more than once (Limiter.round_trip)."""
    if limiter.degraded:
        return limiter.fallback(tenant, rid, tokens, hold_s), None
    calls = [limiter.debit(tenant, rid, tokens, hold_s, scale, force)]
    if lease is not None:
        calls.append(lease)

    def orphan() -> tuple[Call, ...]:
        back = (
            (leases.give_back(ticket, released=True),)
            if lease is not None and ticket is not None
            else ()
        )
        return (limiter.refund(tenant, rid), *back)

    out = await limiter.round_trip(calls, tenant, rid, orphan, resent)
    acquired = limiter.answer(tenant, rid, tokens, hold_s, out)
    return acquired, (out[1] if lease is not None and isinstance(out, list) else None)


def forced(
    limiter: Limiter,
    tenant: Tenant,
    rid: str,
    tokens: int,
    hold_s: float,
    scale: float,
    lease: Call,
    ticket: str,
) -> Awaitable[tuple[Acquired, Any]]:
    """`debit` for a request answered ahead (answer_ahead.py): booked past any limit. The tenant
    counts as having a request ahead from this call on, not from when the round trip starts."""
    done = limiter.count_ahead(tenant, tokens)

    async def run() -> tuple[Acquired, Any]:
        try:
            return await debit(limiter, tenant, rid, tokens, hold_s, scale, lease, ticket, True)
        finally:
            done()

    return run()


async def settle(limiter: Limiter, items: Sequence[Settling], backs: Sequence[Call]) -> list[int]:
    """Settle each reservation and send `backs` (one lease release per item) in one round trip;
    the tokens refunded to each. What Redis cannot take now is owed (the backlog)."""
    own = limiter.settle_calls(items)
    calls: list[Call] = []
    at: list[int] = []  # per item: index of its settlement's reply, or -1
    gone: list[int] = []  # per item: index of its lease release's reply
    for call, back in zip(own, backs, strict=True):
        at.append(len(calls) if call is not None else -1)
        if call is not None:
            calls.append(call)
        gone.append(len(calls))
        calls.append(back)
    out = await limiter.owe(calls)
    if out is not None:
        for i in gone:
            leases.given_back(calls[i].args[0], out[i])
    return limiter.settled(items, [out[i] if out is not None and i >= 0 else None for i in at])
