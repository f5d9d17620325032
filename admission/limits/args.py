"""The scripts' arguments for a tenant's limits: integer micro-units, encoded once per limits."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from admission.policy import Limits

U = 1_000_000  # micro-units per request or token: integer arithmetic in the scripts


@dataclass(frozen=True)
class Rates:
    """A tenant's limits as the scripts take them: integer micro-units."""

    req_cap_u: int
    req_rate_u: int
    tok_cap_u: int
    tok_rate_u: int

    @classmethod
    def of(cls, lim: Limits, scale: float = 1.0) -> Rates:
        """`scale` < 1 slows the refill (memory-aware limits); capacities stay."""
        return cls(
            req_cap_u=lim.request_burst * U,
            req_rate_u=max(1, round(lim.requests_per_s * scale * U)),
            tok_cap_u=lim.token_burst * U,
            tok_rate_u=max(1, round(lim.tokens_per_min * scale * U / 60)),
        )


# The scripts' constant arguments, per limits (a reload makes new ones), encoded once: redis-py
# packs bytes as they are, where each int or str argument costs a conversion per request.
@functools.lru_cache(maxsize=4096)
def acquire_args(
    lim: Limits, scale: float, lease_ttl_us: int
) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    r = Rates.of(lim, scale)
    head = [r.req_cap_u, r.req_rate_u, U, r.tok_cap_u, r.tok_rate_u]
    tail = [int(lim.burst_window_s * U), lim.burst_max, lim.max_concurrent, lease_ttl_us]
    return tuple(b"%d" % x for x in head), tuple(b"%d" % x for x in tail)


@functools.lru_cache(maxsize=4096)
def settle_args(lim: Limits) -> tuple[bytes, bytes]:
    r = Rates.of(lim)
    return b"%d" % r.tok_cap_u, b"%d" % r.tok_rate_u
