"""Per-tenant limits in Redis: one atomic script debits every bucket, another settles usage.

A Redis that cannot answer within the policy's short timeouts turns into fail-open (local
buckets, `limits.local`) or fail-closed (`BackendUnavailable`). After a failure Redis is left
alone for `RETRY_AFTER_FAILURE_S`, then tried again: recovery needs no operator.

The limiter is a small object with one verb pair, `acquire` / `settle`, in the manner of
lua-resty-limit-traffic. It undoes only its own work (the reservation of a call that may have
run); what rides along with it in the same round trip (`also`, e.g. a node lease) belongs to the
caller, who gets its result back and decides.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from admission import store
from admission.errors import AdmissionError, BackendUnavailable, RequestTooLarge, Throttled
from admission.lag import LoopLag
from admission.limits.args import U, acquire_args, settle_args
from admission.limits.local import LocalLimits
from admission.metrics import Metrics
from admission.policy import FailureMode, Policy, Tenant
from admission.store import REDIS_DOWN, Call, PoolBusy, Store, keys

log = logging.getLogger(__name__)

RETRY_AFTER_FAILURE_S = 1.0
BUSY_WAIT_S = 15.0  # how long an admission waits in line for a pooled Redis connection
ROOM_FRESH_S = 1.0  # a tenant's figures from Redis older than this never let a request ahead


class Acquired(NamedTuple):
    """What `acquire` decided. `denied` is the error to answer with (None: admitted).

    `mode` is "redis" or "local" (fail-open). `also` is the result of the companion call, or
    None when it did not run *or may have run* (the round trip failed): the caller undoes it.
    `over`: the limit a forced debit went past ("" when none did).
    """

    mode: str
    also: Any = None
    denied: AdmissionError | None = None
    over: str = ""


@dataclass(slots=True)
class _Room:
    """A tenant's figures in the last reply from Redis: levels after that debit (micro-units),
    requests running and requests in the burst window."""

    at: float
    req_u: int
    tok_u: int
    running: int
    in_window: int


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
        self._room: dict[str, _Room] = {}  # tenant → its figures in the last reply
        self._ahead: dict[str, tuple[int, int]] = {}  # tenant → (requests, tokens) unconfirmed

    @property
    def backlog(self) -> store.Backlog:
        return self.store.backlog

    @property
    def degraded(self) -> bool:
        return self.clock() < self._down_until

    def room_ahead(self, tenant: Tenant, tokens: int) -> bool:
        """Whether the tenant's last figures from Redis (at most ROOM_FRESH_S old) leave room
        for twice what this sidecar would then have let through ahead and not seen booked
        (this request included), on every limit: then `acquire_forced` may follow the answer.
        Refill since then is not counted. The other half is left to what other sidecars take
        meanwhile: a limit is passed only if they take more than that within the figures'
        age (counted: `admission_ahead_total{result="over_limits"}`), and the debt is paid."""
        r = self._room.get(tenant.id)
        if r is None or self.degraded or self.clock() - r.at > ROOM_FRESH_S:
            return False
        n, tok = self._ahead.get(tenant.id, (0, 0))
        m, lim = 2 * (n + 1), tenant.limits
        return (
            r.req_u >= m * U
            and r.tok_u >= 2 * (tok + tokens) * U
            and (not lim.max_concurrent or r.running + m <= lim.max_concurrent)
            and (not lim.burst_max or r.in_window + m <= lim.burst_max)
        )

    def headroom(self, tenant: Tenant, denied: str = "", wait_s: float = 0.0) -> dict[str, float]:
        """The tenant's request and token buckets as the last reply from Redis left them,
        refilled since: capacity, what is left, seconds until full again (OpenAI's
        x-ratelimit-* headers). `denied`: the limit that refused this request (nothing left of
        it for `wait_s`). Without a reply yet (or in the failure mode), capacities only."""
        lim = tenant.limits
        out: dict[str, float] = {"requests": lim.request_burst, "tokens": lim.token_burst}
        r = self._room.get(tenant.id)
        if r is not None and not self.degraded:
            dt = max(0.0, self.clock() - r.at)
            for kind, level, cap, rate in (
                ("requests", r.req_u / U, lim.request_burst, lim.requests_per_s),
                ("tokens", r.tok_u / U, lim.token_burst, lim.tokens_per_min / 60),
            ):
                now = min(cap, level + rate * dt)
                out[f"{kind}_remaining"] = max(0, int(now))
                out[f"{kind}_reset_s"] = round((cap - now) / rate, 3) if rate > 0 else 0.0
        if denied:
            kind = "tokens" if denied.startswith("tokens") else "requests"
            out[f"{kind}_remaining"] = 0
            out[f"{kind}_reset_s"] = round(wait_s, 3)
        return out

    async def acquire(
        self,
        tenant: Tenant,
        rid: str,
        tokens: int,
        lease_ttl_s: float,
        also: Call | None = None,
        scale: float = 1.0,
        give_back: Callable[[], Call] | None = None,
        force: bool = False,
    ) -> Acquired:
        """Debit one request and `tokens` LLM tokens, all-or-nothing, with `also` in the same
        round trip. Denials (Throttled, RequestTooLarge, BackendUnavailable under fail-closed)
        come back in `Acquired.denied`, so that the caller can undo `also` first. `scale`
        multiplies the refill rates (memory-aware limits). `give_back`: the undo of `also`,
        sent with the refund if the caller is cancelled while the round trip is out. `force`:
        see `acquire_forced`, the way to call it."""
        lim = tenant.limits
        if not self.degraded:
            head, tail = acquire_args(lim, scale, int(lease_ttl_s * U))
            args = [
                *head,
                b"%d" % (tokens * U),
                *tail,
                rid,
                b"%d" % tokens,
                b"1" if force else b"0",
            ]

            calls = [Call("acquire", keys.tenant_keys(tenant.id, rid), args)]
            if also is not None:
                calls.append(also)

            # If the caller leaves (cancelled) while this is out, it ran anyway: give it back.
            def orphan() -> tuple[Call, ...]:
                undo = (give_back(),) if give_back is not None else ()
                return (self.settle_call(tenant, rid, 0), *undo)

            out = await self._run_waiting(calls, tenant, rid, orphan)
            if isinstance(out, AdmissionError):
                return Acquired("redis", None, out)
            if out is not None:
                self._recovered()
                res = out[0]
                if isinstance(res, Exception):
                    raise res
                extra = out[1] if also is not None else None
                if int(res[0]) == 1:
                    if len(res) < 6:  # a request asked again, charged already: no figures
                        return Acquired("redis", extra)
                    self._room[tenant.id] = _Room(
                        self.clock(), int(res[1]), int(res[2]), int(res[3]), int(res[4])
                    )
                    return Acquired("redis", extra, over=_s(res[5]))
                self._room.pop(tenant.id, None)
                return Acquired("redis", extra, _denial(_s(res[1]), res, tokens))
        return self._acquire_local(tenant, rid, tokens, lease_ttl_s)

    def acquire_forced(
        self,
        tenant: Tenant,
        rid: str,
        tokens: int,
        lease_ttl_s: float,
        also: Call | None = None,
        scale: float = 1.0,
        give_back: Callable[[], Call] | None = None,
    ) -> Awaitable[Acquired]:
        """`acquire` for a request let through already (`room_ahead`): debit it past any limit
        (`Acquired.over` names the first it went past). The tenant counts as having a request
        ahead from this call on (not from when the round trip starts)."""
        n, tok = self._ahead.get(tenant.id, (0, 0))
        self._ahead[tenant.id] = (n + 1, tok + tokens)

        async def forced() -> Acquired:
            try:
                return await self.acquire(
                    tenant, rid, tokens, lease_ttl_s, also, scale, give_back, force=True
                )
            finally:
                n, tok = self._ahead.pop(tenant.id, (1, tokens))
                if n > 1:
                    self._ahead[tenant.id] = (n - 1, tok - tokens)

        return forced()

    async def _run_waiting(
        self, calls: list[Call], tenant: Tenant, rid: str, orphan: store.Orphan = None
    ) -> list[Any] | AdmissionError | None:
        """Run the acquire round trip. Every pooled connection in use is this process's
        overload, not an outage: nothing was sent, so nothing to give back; wait in line for a
        connection again (each try waits `pool_wait_ms`) for up to `busy_wait_s`, then refuse
        (503 admission_busy). None: Redis is unavailable (the failure mode applies)."""
        busy_until = self.clock() + self.busy_wait_s
        while True:
            try:
                return list(await self.store.scripts.run(*calls, orphan=orphan))
            except PoolBusy:
                self.metrics.redis_errors.labels("pool_busy").inc()
                if self.clock() >= busy_until:
                    return BackendUnavailable(
                        "admission busy: retry shortly", code="admission_busy", retry_after=1
                    )
            except REDIS_DOWN as exc:
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

    async def settle(
        self, tenant: Tenant | None, rid: str, actual_tokens: int, also: Call | None = None
    ) -> int:
        """Refund (positive) or charge (negative) the difference to the reservation; idempotent.

        `also` (the node lease release) rides in the same round trip. With Redis unreachable
        both go to the backlog (0 is returned)."""
        return (await self.settle_many([(tenant, rid, actual_tokens, also, False)]))[0]

    async def settle_many(
        self, items: list[tuple[Tenant | None, str, int, Call | None, bool]]
    ) -> list[int]:
        """`settle` for many reservations (an edge's batch of releases) in one round trip.
        Each item: tenant, request id, actual tokens, what rides along, and whether it is the
        release of a request answered ahead (settle.lua then marks a reservation not yet
        booked)."""
        calls: list[Call] = []
        slots: list[int] = []  # per item: index of its settle result, or -1
        for tenant, rid, actual, also, released in items:
            self._local.release(rid)
            slots.append(len(calls) if tenant is not None else -1)
            if tenant is not None:
                calls.append(self.settle_call(tenant, rid, actual, released))
            if also is not None:
                calls.append(also)
        if not calls:
            return [0] * len(items)
        if self.degraded:
            self.backlog.add(*calls)
            return [0] * len(items)
        try:
            out = await self.store.scripts.run(*calls)
        except PoolBusy:
            self.backlog.add(*calls)  # owed, delivered by the backlog; Redis is not down
            return [0] * len(items)
        except REDIS_DOWN as exc:
            if not self.lag.overloaded():
                self._failed("settle", exc)
            self.backlog.add(*calls)
            return [0] * len(items)
        deltas = []
        for (tenant, *_rest), slot in zip(items, slots, strict=True):
            if tenant is None:
                deltas.append(0)
                continue
            if isinstance(out[slot], Exception):
                raise out[slot]
            delta = int(out[slot][1])
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

    def _acquire_local(self, tenant: Tenant, rid: str, tokens: int, ttl_s: float) -> Acquired:
        settings = self.policy().redis
        if settings.failure_mode == FailureMode.CLOSED:
            return Acquired(
                "local",
                denied=BackendUnavailable(
                    "rate-limit store unavailable", code="limiter_unavailable", retry_after=1
                ),
            )
        try:
            self._local.acquire(
                tenant.id, tenant.limits, tokens, settings.fail_open_fraction, rid, ttl_s
            )
        except (Throttled, RequestTooLarge) as exc:
            return Acquired("local", denied=exc)
        return Acquired("local")


def _denial(reason: str, res: Any, tokens: int) -> AdmissionError:
    if reason.endswith("_exceed_capacity"):
        limit = "tokens_per_min" if reason.startswith("tokens") else "requests_per_s"
        cost = tokens if limit == "tokens_per_min" else 1
        return RequestTooLarge(limit, cost, int(res[3]) // U)
    return Throttled(reason, int(res[2]) / 1000)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
