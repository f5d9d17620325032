"""What a sidecar knows of each tenant's buckets between Redis replies: the figures the last
debit's reply carried, and the requests it let through ahead of their debits since. They answer
two questions — may the next request be answered before Redis books it (`room_ahead`,
scheduling/answer_ahead.py), and what do its x-ratelimit-* headers say (`headroom`) — and
nothing else: Redis stays the only ledger.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from admission.limits.args import U
from admission.policy import Tenant

ROOM_FRESH_S = 1.0  # a tenant's figures from Redis older than this never let a request ahead


@dataclass(slots=True)
class _Room:
    """A tenant's figures in the last reply from Redis: levels after that debit (micro-units),
    requests running and requests in the burst window."""

    at: float
    req_u: int
    tok_u: int
    running: int
    in_window: int
    ahead_ok: bool = True  # False after a refusal: nothing is let through ahead until a debit


class Figures:
    """Per tenant: its figures in the last reply, and (requests, tokens) let through ahead and
    not yet booked."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._room: dict[str, _Room] = {}
        self._ahead: dict[str, tuple[int, int]] = {}

    def debited(self, tenant: Tenant, res: Any) -> None:
        """acquire.lua's reply to a debit that went through: levels, running, in window."""
        self._room[tenant.id] = _Room(
            self.clock(), int(res[1]), int(res[2]), int(res[3]), int(res[4])
        )

    def refused(self, tenant: Tenant, reason: str) -> None:
        """Keep the tenant's figures after a refusal, refilled to now, the refusing bucket
        emptied: the refusal's headers carry both buckets, and nothing is let through ahead
        until a debit succeeds again."""
        r = self._room.get(tenant.id)
        if r is None:
            return
        lim, now = tenant.limits, self.clock()
        dt = max(0.0, now - r.at)
        req = min(lim.request_burst * U, r.req_u + lim.requests_per_s * dt * U)
        tok = min(lim.token_burst * U, r.tok_u + lim.tokens_per_min / 60 * dt * U)
        if reason.startswith("requests"):
            req = 0
        elif reason.startswith("tokens"):
            tok = 0
        self._room[tenant.id] = _Room(now, int(req), int(tok), r.running, r.in_window, False)

    def room_ahead(self, tenant: Tenant, tokens: int) -> bool:
        """Whether the tenant's last figures from Redis (at most ROOM_FRESH_S old) leave room
        for twice what this sidecar would then have let through ahead and not seen booked
        (this request included), on every limit: then a forced debit may follow the answer.
        Refill since then is not counted. The other half is left to what other sidecars take
        meanwhile: a limit is passed only if they take more than that within the figures'
        age (counted: `admission_ahead_total{result="over_limits"}`), and the debt is paid."""
        r = self._room.get(tenant.id)
        if r is None or not r.ahead_ok or self.clock() - r.at > ROOM_FRESH_S:
            return False
        n, tok = self._ahead.get(tenant.id, (0, 0))
        m, lim = 2 * (n + 1), tenant.limits
        return (
            r.req_u >= m * U
            and r.tok_u >= 2 * (tok + tokens) * U
            and (not lim.max_concurrent or r.running + m <= lim.max_concurrent)
            and (not lim.burst_max or r.in_window + m <= lim.burst_max)
        )

    def headroom(
        self, tenant: Tenant, denied: str = "", wait_s: float = 0.0, known: bool = True
    ) -> dict[str, float]:
        """The tenant's request and token buckets as the last reply from Redis left them,
        refilled since, less what was let through ahead since: capacity, what is left, seconds
        until full again (OpenAI's x-ratelimit-* headers). `denied`: the limit that refused
        this request (nothing left of it for `wait_s`). Without a reply yet (or not `known`:
        the failure mode), capacities only."""
        lim = tenant.limits
        out: dict[str, float] = {"requests": lim.request_burst, "tokens": lim.token_burst}
        r = self._room.get(tenant.id)
        if r is not None and known:
            dt = max(0.0, self.clock() - r.at)
            # What was let through ahead of its debit is taken off too: the figures an answer
            # carries never rise while the debits they precede are on their way.
            n, tok = self._ahead.get(tenant.id, (0, 0))
            for kind, level, cap, rate, ahead in (
                ("requests", r.req_u / U, lim.request_burst, lim.requests_per_s, n),
                ("tokens", r.tok_u / U, lim.token_burst, lim.tokens_per_min / 60, tok),
            ):
                now = min(cap, level + rate * dt)
                out[f"{kind}_remaining"] = max(0, int(now) - ahead)
                out[f"{kind}_reset_s"] = round((cap - now) / rate, 3) if rate > 0 else 0.0
        if denied:
            kind = "tokens" if denied.startswith("tokens") else "requests"
            out[f"{kind}_remaining"] = 0
            out[f"{kind}_reset_s"] = round(wait_s, 3)
        return out

    def count_ahead(self, tenant: Tenant, tokens: int) -> Callable[[], None]:
        """Count a request let through ahead of its forced debit (`room_ahead` sees it) until
        the returned function is called, when its round trip is over."""
        n, tok = self._ahead.get(tenant.id, (0, 0))
        self._ahead[tenant.id] = (n + 1, tok + tokens)

        def done() -> None:
            n, tok = self._ahead.pop(tenant.id, (1, tokens))
            if n > 1:
                self._ahead[tenant.id] = (n - 1, tok - tokens)

        return done
