"""Fail-open limits: in-process limits used while Redis cannot answer.

Each sidecar grants itself `fail_open_fraction` of every limit (rates, bursts, the burst guard
and the concurrency cap), so N sidecars cannot jointly exceed a tenant's limits by much while
the shared state is out of reach. The buckets outlive an outage: a Redis that flaps gets no
fresh burst per episode (time refills them, as in Redis).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from admission.errors import RequestTooLarge, Throttled
from admission.policy import Limits

SWEEP_S = 1.0  # expired local concurrency slots are freed at most this often per tenant


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


def _share(limit: int, fraction: float) -> int:
    return max(1, math.floor(limit * fraction))


class LocalLimits:
    """Every tenant's local limits. `active` says whether any request was decided locally
    since Redis was last reachable (for the recovery log line)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.active = False
        self._b: dict[tuple[str, str], LocalBucket] = {}
        self._recent: dict[str, deque[float]] = {}  # admission times, for the burst guard
        # tenant → {rid: expiry}: the requests admitted locally. A release may reach another
        # sidecar; the expiry (the lease TTL, as in Redis) bounds how long a slot stays taken.
        self._inflight: dict[str, dict[str, float]] = {}
        self._owner: dict[str, str] = {}  # rid → tenant
        self._swept: dict[str, float] = {}  # tenant → when its expired slots were last freed

    def acquire(
        self,
        tenant: str,
        lim: Limits,
        tokens: int,
        fraction: float,
        rid: str = "",
        ttl_s: float = 600.0,
    ) -> None:
        """Debit one request and `tokens`, all-or-nothing; raise Throttled / RequestTooLarge.
        A request admitted here holds a local concurrency slot until `release(rid)`."""
        self.active = True
        if tokens > lim.token_burst:
            raise RequestTooLarge("tokens_per_min", tokens, lim.token_burst)
        rq = self._bucket(tenant, "rq", lim.request_burst * fraction, lim.requests_per_s * fraction)
        tk = self._bucket(
            tenant, "tk", lim.token_burst * fraction, lim.tokens_per_min * fraction / 60
        )
        # Check everything before debiting anything: all-or-nothing, as in Redis.
        if (wait := rq.wait_s(1)) > 0:
            raise Throttled("requests_per_s", wait)
        if (wait := tk.wait_s(tokens)) > 0:
            raise Throttled("tokens_per_min", wait)
        now = self.clock()
        recent = self._recent.setdefault(tenant, deque())
        if lim.burst_max > 0:
            while recent and recent[0] <= now - lim.burst_window_s:
                recent.popleft()
            if len(recent) >= _share(lim.burst_max, fraction):
                raise Throttled("burst", recent[0] + lim.burst_window_s - now)
        inflight = self._inflight.setdefault(tenant, {})
        if now - self._swept.get(tenant, float("-inf")) >= SWEEP_S:  # not a scan per request
            self._swept[tenant] = now
            for t in [t for t, exp in inflight.items() if exp <= now]:
                self.release(t)
        if lim.max_concurrent > 0 and len(inflight) >= _share(lim.max_concurrent, fraction):
            raise Throttled("concurrency", 1.0)
        rq.level -= 1
        tk.level -= tokens
        if lim.burst_max > 0:
            recent.append(now)
        if rid:
            inflight[rid] = now + ttl_s
            self._owner[rid] = tenant

    def release(self, rid: str) -> None:
        """Free the local concurrency slot of `rid` (no-op for requests admitted in Redis)."""
        tenant = self._owner.pop(rid, None)
        if tenant is not None:
            self._inflight[tenant].pop(rid, None)

    def _bucket(self, tenant: str, kind: str, cap: float, rate: float) -> LocalBucket:
        b = self._b.get((tenant, kind))
        if b is None or b.capacity != cap or b.rate_per_s != rate:
            b = LocalBucket(max(cap, 1.0), rate, self.clock)
            self._b[(tenant, kind)] = b
        return b
