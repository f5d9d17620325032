"""Fail-open limits: in-process token buckets used while Redis cannot answer.

Each sidecar grants itself `fail_open_fraction` of every rate, so N sidecars cannot jointly
exceed a tenant's limit by much while the shared buckets are out of reach.
"""

from __future__ import annotations

from collections.abc import Callable

from admission.errors import RequestTooLarge, Throttled
from admission.policy import Limits


class LocalBucket:
    """In-process token bucket (monotonic clock, injected for tests)."""

    def __init__(self, capacity: float, rate_per_s: float, clock: Callable[[], float]) -> None:
        self.capacity = capacity
        self.rate_per_s = rate_per_s
        self.clock = clock
        self.level = capacity
        self.at = clock()

    def wait_s(self, cost: float) -> float:
        """Seconds until `cost` fits (0 if it fits now); refills but debits nothing."""
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate_per_s)
        self.at = now
        return 0.0 if cost <= self.level else (cost - self.level) / self.rate_per_s


class LocalLimits:
    """Every tenant's local buckets; `clear()` when Redis is back."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._b: dict[tuple[str, str], LocalBucket] = {}

    def __bool__(self) -> bool:
        return bool(self._b)

    def clear(self) -> None:
        self._b.clear()

    def acquire(self, tenant: str, lim: Limits, tokens: int, fraction: float) -> None:
        """Debit one request and `tokens`, all-or-nothing; raise Throttled / RequestTooLarge."""
        if tokens > lim.token_burst:
            raise RequestTooLarge("tokens_per_min", tokens, lim.token_burst)
        rq = self._bucket(tenant, "rq", lim.request_burst * fraction, lim.requests_per_s * fraction)
        tk = self._bucket(
            tenant, "tk", lim.token_burst * fraction, lim.tokens_per_min * fraction / 60
        )
        # Check both before debiting either: all-or-nothing, as in Redis.
        if (wait := rq.wait_s(1)) > 0:
            raise Throttled("requests_per_s", wait)
        if (wait := tk.wait_s(tokens)) > 0:
            raise Throttled("tokens_per_min", wait)
        rq.level -= 1
        tk.level -= tokens

    def _bucket(self, tenant: str, kind: str, cap: float, rate: float) -> LocalBucket:
        b = self._b.get((tenant, kind))
        if b is None or b.capacity != cap or b.rate_per_s != rate:
            b = LocalBucket(max(cap, 1.0), rate, self.clock)
            self._b[(tenant, kind)] = b
        return b
