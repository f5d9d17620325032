"""Per-tenant limits in Redis: one atomic script debits every bucket, another settles usage.

A Redis that cannot answer within the policy's short timeouts turns into fail-open (local
buckets, `limits.local`) or fail-closed (`BackendUnavailable`). After a failure Redis is left
alone for `RETRY_AFTER_FAILURE_S`, then tried again: recovery needs no operator.

The limiter is a small object with one verb pair, `acquire` / `settle`, in the manner of
lua-resty-limit-traffic, each also in pieces — the call (`debit`, `settle_calls`), the round
trip under the failure mode (`round_trip`, `owe`) and the reading of the reply (`answer`,
`settled`) — so that the dispatcher can send its node lease in the same round trip
(scheduling/round_trip.py). The limiter knows nothing of leases: it undoes only its own work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from admission import store
from admission.errors import AdmissionError, BackendUnavailable, RequestTooLarge, Throttled
from admission.limits.args import U, acquire_args, settle_args
from admission.limits.figures import Figures
from admission.limits.local import LocalLimits
from admission.loop_lag import LoopLag
from admission.metrics import Metrics
from admission.policy import FailureMode, Policy, Tenant
from admission.store import REDIS_DOWN, Call, PoolBusy, Store, keys

log = logging.getLogger(__name__)

RETRY_AFTER_FAILURE_S = 1.0
BUSY_WAIT_S = 15.0  # how long an admission waits in line for a pooled Redis connection


class Acquired(NamedTuple):
    """What `acquire` decided. `denied` is the error to answer with (None: admitted).

    `mode` is "redis" or "local" (fail-open: the round trip failed, and may have run).
    `over`: the limit a forced debit went past ("" when none did).
    """

    mode: str
    denied: AdmissionError | None = None
    over: str = ""


# What settling takes per reservation: tenant (None: unknown), request id, actual tokens,
# and whether it is the release of a request answered ahead.
Settling = tuple[Tenant | None, str, int, bool]


class Limiter:
    """Checks and settles a tenant's limits; Redis-backed, with the policy's failure mode."""

    def __init__(
        self,
        st: Store,
        policy: Callable[[], Policy],
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = st
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self._down_until = 0.0
        self.lag = LoopLag()  # the server runs its probe; a late loop is not an outage
        self._local = LocalLimits(clock)
        self.busy_wait_s = BUSY_WAIT_S
        self.figures = Figures(clock)  # each tenant's buckets as this sidecar last saw them

    @property
    def backlog(self) -> store.Backlog:
        return self.store.backlog

    @property
    def degraded(self) -> bool:
        return self.clock() < self._down_until

    def room_ahead(self, tenant: Tenant, tokens: int) -> bool:
        """Whether a request may be answered before Redis books it (`Figures.room_ahead`)."""
        return not self.degraded and self.figures.room_ahead(tenant, tokens)

    def headroom(self, tenant: Tenant, denied: str = "", wait_s: float = 0.0) -> dict[str, float]:
        """The x-ratelimit-* figures for an answer to `tenant` (`Figures.headroom`)."""
        return self.figures.headroom(tenant, denied, wait_s, known=not self.degraded)

    def count_ahead(self, tenant: Tenant, tokens: int) -> Callable[[], None]:
        """Count a request let through ahead of its forced debit until the returned function
        is called, when its round trip is over (`Figures.count_ahead`)."""
        return self.figures.count_ahead(tenant, tokens)

    def debit(
        self,
        tenant: Tenant,
        rid: str,
        tokens: int,
        hold_s: float,
        scale: float = 1.0,
        force: bool = False,
    ) -> Call:
        """acquire.lua's call: debit one request and `tokens` LLM tokens, all-or-nothing, and
        hold the reservation and a concurrency slot for `hold_s`. `scale` multiplies the refill
        rates (memory-aware limits); `force`: debit past any limit (a request let through
        already, `room_ahead`). Sent by `round_trip`, read by `answer`."""
        head, tail = acquire_args(tenant.limits, scale, int(hold_s * U))
        args = [*head, b"%d" % (tokens * U), *tail, rid, b"%d" % tokens, b"1" if force else b"0"]
        return Call("acquire", keys.tenant_keys(tenant.id, rid), args)

    def refund(self, tenant: Tenant, rid: str) -> Call:
        """The undo of `debit`: the whole reservation back, the slot freed (idempotent)."""
        return self.settle_call(tenant, rid, 0)

    async def acquire(
        self,
        tenant: Tenant,
        rid: str,
        tokens: int,
        hold_s: float,
        scale: float = 1.0,
        force: bool = False,
    ) -> Acquired:
        """`debit` alone in its round trip, read. Denials (Throttled, RequestTooLarge,
        BackendUnavailable under fail-closed) come back in `Acquired.denied`."""
        if self.degraded:
            return self.fallback(tenant, rid, tokens, hold_s)
        call = self.debit(tenant, rid, tokens, hold_s, scale, force)
        out = await self.round_trip([call], tenant, rid, lambda: (self.refund(tenant, rid),))
        return self.answer(tenant, rid, tokens, hold_s, out)

    def answer(
        self,
        tenant: Tenant,
        rid: str,
        tokens: int,
        hold_s: float,
        out: list[Any] | AdmissionError | None,
    ) -> Acquired:
        """What `round_trip` gave for a round trip whose first call is this `debit`: the
        debit's answer, or the failure mode's when Redis could not be used (`out` None)."""
        if isinstance(out, AdmissionError):
            return Acquired("redis", out)
        if out is None:
            return self.fallback(tenant, rid, tokens, hold_s)
        self._recovered()
        res = out[0]
        if isinstance(res, Exception):
            raise res
        if int(res[0]) == 1:
            if len(res) < 6:  # a request asked again, charged already: no figures
                return Acquired("redis")
            self.figures.debited(tenant, res)
            return Acquired("redis", over=_s(res[5]))
        reason = _s(res[1])
        self.figures.refused(tenant, reason)
        return Acquired("redis", _denial(reason, res, tokens))

    async def round_trip(
        self,
        calls: list[Call],
        tenant: Tenant,
        rid: str,
        orphan: store.Orphan = None,
        resent: Callable[[], None] | None = None,
    ) -> list[Any] | AdmissionError | None:
        """Send a round trip that debits `rid` with whatever its caller adds (`orphan`: what to
        send back if the caller is cancelled meanwhile; `resent`: called before each send after
        the first, when an earlier copy may still run). A full pool or a late event loop is this
        process's overload, not an outage: wait in line (each try `pool_wait_ms`) up to
        `busy_wait_s`, then refuse 503 admission_busy / sidecar_overloaded, the debit refunded
        (on Redis Cluster it may have run beside a call whose pool was full). None: Redis is
        unavailable (the failure mode applies; the debit, which may have run, is refunded; the
        caller's other calls are the caller's to undo)."""
        busy_until = self.clock() + self.busy_wait_s
        dropped, sends = False, 0
        while True:
            if sends and resent is not None:
                resent()
            sends += 1
            try:
                return list(await self.store.scripts.run(*calls, orphan=orphan))
            except PoolBusy:
                self.metrics.redis_errors.labels("pool_busy").inc()
                if self.clock() >= busy_until:
                    # Redis Cluster: the debit may have run (a no-op refund if it did not).
                    self.backlog.add(self.settle_call(tenant, rid, 0))
                    return BackendUnavailable(
                        "admission busy: retry shortly", code="admission_busy", retry_after=1
                    )
            except REDIS_DOWN as exc:
                # One pooled connection closed under us (`store.dropped`): asked again at once,
                # before it counts as Redis being away (acquire.lua and lease.lua are idempotent).
                if not dropped and self._dropped(exc):
                    dropped = True
                    continue
                late = await self.lag.after_timeout(
                    self.metrics, "acquire", busy_until, self.clock()
                )
                if late == "again":  # in line, as for a busy pool: never the failure mode
                    continue
                # It may have run anyway: give back whatever it reserved (a request admitted
                # locally then is free of charge in Redis; its release is a no-op).
                self.backlog.add(self.settle_call(tenant, rid, 0))
                if late == "refuse":
                    return self.lag.refusal()
                self._failed("acquire", exc)
                return None

    async def settle(self, tenant: Tenant | None, rid: str, actual_tokens: int) -> int:
        """Refund (positive) or charge (negative) the difference to the reservation; idempotent.
        With Redis unreachable the call goes to the backlog (0 is returned). Many at once, with
        the node leases' releases: scheduling/round_trip.py's `settle`."""
        item = (tenant, rid, actual_tokens, False)
        (call,) = self.settle_calls([item])
        out = await self.owe([call]) if call is not None else None
        return self.settled([item], [out[0] if out else None])[0]

    def settle_calls(self, items: Sequence[Settling]) -> list[Call | None]:
        """settle.lua's call per item (None for an unknown tenant); frees the local buckets'
        slots at once. Each item: tenant, request id, actual tokens, and whether it is the
        release of a request answered ahead (settle.lua then marks a reservation not yet
        booked)."""
        calls: list[Call | None] = []
        for tenant, rid, actual, released in items:
            self._local.release(rid)
            calls.append(
                None if tenant is None else self.settle_call(tenant, rid, actual, released)
            )
        return calls

    async def owe(self, calls: list[Call]) -> list[Any] | None:
        """Send calls that must reach Redis (settlements, and what their caller adds): their
        replies, or None when they went to the backlog instead (Redis failed or is left alone,
        or the pool is busy), which delivers them later."""
        if not calls:
            return []
        if self.degraded:
            self.backlog.add(*calls)
            return None
        dropped = False
        while True:
            try:
                return list(await self.store.scripts.run(*calls))
            except PoolBusy:
                self.backlog.add(*calls)  # owed, delivered by the backlog; Redis is not down
            except REDIS_DOWN as exc:
                # As in round_trip (settlements and lease releases are idempotent): seen on a
                # loaded Redis Cluster, it put a sidecar in the failure mode for half a second.
                if not dropped and self._dropped(exc):
                    dropped = True
                    continue
                if not self.lag.overloaded():
                    self._failed("settle", exc)
                self.backlog.add(*calls)
            return None

    def settled(self, items: Sequence[Settling], replies: Sequence[Any]) -> list[int]:
        """The tokens refunded (positive) or charged (negative) per item, from settle.lua's
        replies (None: not sent, or owed: 0)."""
        deltas = []
        for (tenant, *_rest), res in zip(items, replies, strict=True):
            if tenant is None or res is None:
                deltas.append(0)
                continue
            if isinstance(res, Exception):
                raise res
            delta = int(res[1])
            if delta > 0:
                self.metrics.settled_tokens.labels(tenant.id, "refund").inc(delta)
            elif delta < 0:
                self.metrics.settled_tokens.labels(tenant.id, "overage").inc(-delta)
            deltas.append(delta)
        return deltas

    @staticmethod
    def settle_call(tenant: Tenant, rid: str, actual_tokens: int, released: bool = False) -> Call:
        k = keys.tenant_keys(tenant.id, rid)
        return Call(
            "settle",
            [k[1], k[3], k[4]],
            [*settle_args(tenant.limits), actual_tokens, rid, b"1" if released else b"0"],
        )

    def _dropped(self, exc: BaseException) -> bool:
        """Whether `exc` is one pooled connection closed under a round trip (counted)."""
        if not store.dropped(exc):
            return False
        self.metrics.redis_errors.labels("dropped").inc()
        return True

    def _failed(self, op: str, exc: BaseException) -> None:
        self.metrics.redis_errors.labels(op).inc()
        if not self.degraded:
            log.error(
                "redis unavailable during %s (%s: %.200s): failure mode %s",
                op,
                type(exc).__name__,
                exc,
                self.policy().redis.failure_mode.value,
            )
        self._down_until = self.clock() + RETRY_AFTER_FAILURE_S
        self.metrics.redis_fallback.set(1)

    def _recovered(self) -> None:
        # The local buckets are kept, not refilled: a Redis that flaps must not hand out a
        # fresh local burst at each episode. Time refills them, as it does in Redis.
        if self._local.active:
            log.warning("redis reachable again: limits enforced in Redis")
            self._local.active = False
        self.metrics.redis_fallback.set(0)

    def fallback(self, tenant: Tenant, rid: str, tokens: int, ttl_s: float) -> Acquired:
        """The failure mode's answer for a debit Redis could not take."""
        settings = self.policy().redis
        if settings.failure_mode == FailureMode.CLOSED:
            return Acquired(
                "local",
                BackendUnavailable(
                    "rate-limit store unavailable", code="limiter_unavailable", retry_after=1
                ),
            )
        try:
            self._local.acquire(
                tenant.id, tenant.limits, tokens, settings.fail_open_fraction, rid, ttl_s
            )
        except (Throttled, RequestTooLarge) as exc:
            return Acquired("local", exc)
        return Acquired("local")


def _denial(reason: str, res: Any, tokens: int) -> AdmissionError:
    if reason.endswith("_exceed_capacity"):
        limit = "tokens_per_min" if reason.startswith("tokens") else "requests_per_s"
        cost = tokens if limit == "tokens_per_min" else 1
        return RequestTooLarge(limit, cost, int(res[3]) // U)
    return Throttled(reason, int(res[2]) / 1000)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
