"""Per-tenant limits in Redis: one atomic script debits every bucket, another settles usage.

This module is the one boundary where redis-py errors become ours: a Redis that cannot answer
within the policy's short timeouts turns into fail-open (local in-process buckets at a fraction
of each rate, so N sidecars cannot jointly exceed the limit by much) or fail-closed
(`BackendUnavailable`). After a failure Redis is left alone for `RETRY_AFTER_FAILURE_S`, then
tried again: recovery needs no operator.

A call that timed out may still have run (Redis was slow, not gone), and a release that could
not reach Redis would leave a node lease and a concurrency slot taken until their TTL: both go
to the `Backlog`, which gives them back once Redis answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as rex

from admission import keys
from admission.errors import BackendUnavailable, RequestTooLarge, Throttled
from admission.metrics import Metrics
from admission.policy import Limits, Policy, RedisSettings, Tenant
from admission.scripts import Call, Scripts

log = logging.getLogger(__name__)

U = 1_000_000  # micro-units per request or token: integer arithmetic in the scripts
RETRY_AFTER_FAILURE_S = 1.0
REDIS_DOWN = (rex.ConnectionError, rex.TimeoutError, rex.BusyLoadingError, OSError)


def connect(settings: RedisSettings) -> Any:
    """A redis-py asyncio client with short timeouts and a *blocking* pool.

    The default pool raises once all connections are busy; a blocking pool makes the excess
    wait `pool_wait_ms` instead, which under bursts is the difference between a queue and 503s.
    """
    timeout = settings.command_timeout_ms / 1000
    if settings.cluster:
        return aioredis.RedisCluster.from_url(
            settings.url,
            socket_timeout=timeout,
            socket_connect_timeout=settings.connect_timeout_ms / 1000,
            max_connections=settings.pool_size,
        )
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.url,
        max_connections=settings.pool_size,
        timeout=settings.pool_wait_ms / 1000,
        socket_timeout=timeout,
        socket_connect_timeout=settings.connect_timeout_ms / 1000,
    )
    return aioredis.Redis.from_pool(pool)  # the client owns (and closes) its pool


@dataclass(frozen=True)
class Rates:
    """A tenant's limits as the scripts take them: integer micro-units."""

    req_cap_u: int
    req_rate_u: int
    tok_cap_u: int
    tok_rate_u: int

    @classmethod
    def of(cls, lim: Limits) -> Rates:
        return cls(
            req_cap_u=lim.request_burst * U,
            req_rate_u=max(1, round(lim.requests_per_s * U)),
            tok_cap_u=lim.token_burst * U,
            tok_rate_u=max(1, round(lim.tokens_per_min * U / 60)),
        )


class Backlog:
    """Releases and compensations that could not reach Redis, replayed in order once it answers.

    Everything put here is idempotent (settle per ticket, ZREM of a lease), so replaying a call
    whose original did run late is harmless. Bounded: past `MAX` the oldest is dropped (counted);
    the TTLs in Redis free what a dropped entry held, later.
    """

    MAX = 100_000

    def __init__(self, scripts: Scripts, metrics: Metrics) -> None:
        self.scripts = scripts
        self.metrics = metrics
        self._q: deque[tuple[Call, ...]] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def add(self, *calls: Call) -> None:
        if len(self._q) >= self.MAX:
            self._q.popleft()
            self.metrics.redis_backlog_dropped.inc()
        self._q.append(calls)
        self.metrics.redis_backlog.set(len(self._q))

    async def flush(self) -> bool:
        """Replay in order until empty (True) or Redis fails again (False; kept for later)."""
        while self._q:
            try:
                out = await self.scripts.run(*self._q[0])
            except REDIS_DOWN:
                return False
            for r in out:
                if isinstance(r, Exception):  # a script error will not heal by retrying
                    log.error("backlog call failed, dropped: %s", r)
            self._q.popleft()
            self.metrics.redis_backlog.set(len(self._q))
        return True

    async def run(self, period_s: float = 0.5) -> None:
        """Flush every `period_s` while anything waits, until cancelled."""
        while True:
            await asyncio.sleep(period_s)
            if self._q:
                await self.flush()


class LocalBucket:
    """In-process token bucket for fail-open mode (monotonic clock, injected for tests)."""

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


class Limiter:
    """Checks and settles a tenant's limits; Redis-backed, with the policy's failure mode."""

    def __init__(
        self,
        redis: Any,
        policy: Callable[[], Policy],
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.scripts = Scripts(redis)
        self.backlog = Backlog(self.scripts, metrics)
        self._down_until = 0.0
        self._local: dict[tuple[str, str], LocalBucket] = {}

    @property
    def degraded(self) -> bool:
        return self.clock() < self._down_until

    async def acquire(
        self, tenant: Tenant, ticket: str, tokens: int, lease_ttl_s: float, also: Call | None = None
    ) -> tuple[str, Any]:
        """Debit one request and `tokens` LLM tokens; return ("redis" | "local", also's result).

        `also` (the fast path's node lease) rides in the same round trip; its result is None
        when it did not run (Redis down). Raises Throttled (with the limit and Retry-After),
        RequestTooLarge, or BackendUnavailable under fail-closed when Redis is unreachable.
        """
        lim = tenant.limits
        r = Rates.of(lim)
        if not self.degraded:
            args = [
                r.req_cap_u, r.req_rate_u, U,
                r.tok_cap_u, r.tok_rate_u, tokens * U,
                int(lim.burst_window_s * U), lim.burst_max,
                lim.max_concurrent, int(lease_ttl_s * U), ticket, tokens,
            ]  # fmt: skip
            calls = [Call("acquire", keys.tenant_keys(tenant.id, ticket), args)]
            if also is not None:
                calls.append(also)
            try:
                out = await self.scripts.run(*calls)
            except REDIS_DOWN as exc:
                self._failed("acquire", exc)
                # It may have run anyway: give back whatever it reserved (a request admitted
                # locally below is then free of charge in Redis; its release is a no-op).
                self.backlog.add(self._settle_call(tenant, ticket, 0))
                if also is not None and self.policy().redis.failure_mode == "closed":
                    self.backlog.add(undo_lease(also))  # refused below: nothing will release it
            else:
                self._recovered()
                res = out[0]
                if isinstance(res, Exception):
                    raise res
                extra = out[1] if also is not None else None
                if int(res[0]) == 1:
                    return "redis", extra
                if also is not None and also.script == "lease" and _granted(extra):
                    undo = undo_lease(also)
                    try:
                        await self.scripts.run(undo)  # undo the optimistic lease
                    except REDIS_DOWN:
                        self.backlog.add(undo)
                reason = _s(res[1])
                if reason.endswith("_exceed_capacity"):
                    limit = "tokens_per_min" if reason.startswith("tokens") else "requests_per_s"
                    cost = tokens if limit == "tokens_per_min" else 1
                    raise RequestTooLarge(limit, cost, int(res[3]) // U)
                raise Throttled(reason, int(res[2]) / 1000)
        return self._acquire_local(tenant, tokens), None

    async def settle(
        self, tenant: Tenant | None, ticket: str, actual_tokens: int, also: Call | None = None
    ) -> int:
        """Refund (positive) or charge (negative) the difference to the reservation; idempotent.

        `also` (the node lease release) rides in the same round trip. With Redis unreachable
        both go to the backlog (0 is returned)."""
        calls = []
        if tenant is not None:
            calls.append(self._settle_call(tenant, ticket, actual_tokens))
        if also is not None:
            calls.append(also)
        if not calls:
            return 0
        if self.degraded:
            self.backlog.add(*calls)
            return 0
        try:
            out = await self.scripts.run(*calls)
        except REDIS_DOWN as exc:
            self._failed("settle", exc)
            self.backlog.add(*calls)
            return 0
        if tenant is None:
            return 0
        if isinstance(out[0], Exception):
            raise out[0]
        delta = int(out[0][1])
        if delta > 0:
            self.metrics.settled_tokens.labels(tenant.id, "refund").inc(delta)
        elif delta < 0:
            self.metrics.settled_tokens.labels(tenant.id, "overage").inc(-delta)
        return delta

    @staticmethod
    def _settle_call(tenant: Tenant, ticket: str, actual_tokens: int) -> Call:
        r = Rates.of(tenant.limits)
        k = keys.tenant_keys(tenant.id, ticket)
        return Call(
            "settle", [k[1], k[3], k[4]], [r.tok_cap_u, r.tok_rate_u, actual_tokens, ticket]
        )

    def _failed(self, op: str, exc: BaseException) -> None:
        self.metrics.redis_errors.labels(op).inc()
        if not self.degraded:
            log.error(
                "redis unreachable during %s (%s): failure mode %s",
                op,
                type(exc).__name__,
                self.policy().redis.failure_mode,
            )
        self._down_until = self.clock() + RETRY_AFTER_FAILURE_S
        self.metrics.redis_fallback.set(1)

    def _recovered(self) -> None:
        if self._local:
            log.warning("redis reachable again: limits enforced in Redis")
            self._local.clear()
        self.metrics.redis_fallback.set(0)

    def _acquire_local(self, tenant: Tenant, tokens: int) -> str:
        settings = self.policy().redis
        if settings.failure_mode == "closed":
            raise BackendUnavailable(
                "rate-limit store unavailable", code="limiter_unavailable", retry_after=1
            )
        lim = tenant.limits
        if tokens > lim.token_burst:
            raise RequestTooLarge("tokens_per_min", tokens, lim.token_burst)
        f = settings.fail_open_fraction
        rq = self._bucket(tenant.id, "rq", lim.request_burst * f, lim.requests_per_s * f)
        tk = self._bucket(tenant.id, "tk", lim.token_burst * f, lim.tokens_per_min * f / 60)
        # Check both before debiting either: all-or-nothing, as in Redis.
        if (wait := rq.wait_s(1)) > 0:
            raise Throttled("requests_per_s", wait)
        if (wait := tk.wait_s(tokens)) > 0:
            raise Throttled("tokens_per_min", wait)
        rq.level -= 1
        tk.level -= tokens
        return "local"

    def _bucket(self, tenant: str, kind: str, cap: float, rate: float) -> LocalBucket:
        b = self._local.get((tenant, kind))
        if b is None or b.capacity != cap or b.rate_per_s != rate:
            b = LocalBucket(max(cap, 1.0), rate, self.clock)
            self._local[(tenant, kind)] = b
        return b


def lease_release(leases_key: str, ticket: str) -> Call:
    """The ZREM that gives a node lease back (idempotent: harmless if it was never taken)."""
    return Call(None, [], ["ZREM", leases_key, ticket])


def undo_lease(lease: Call) -> Call:
    """The release of whatever the lease.lua call `lease` may have taken."""
    return lease_release(lease.keys[0], lease.args[2])


def _granted(res: Any) -> bool:
    return isinstance(res, list) and bool(res) and int(res[0]) == 1


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
