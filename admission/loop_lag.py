"""How late this process's event loop runs: an overloaded sidecar is not a Redis outage.

A Redis call that times out because the loop ran its timer late — its reply sat in the socket
while the loop worked through a backlog — looks like Redis going away. Taken as an outage it
would switch the failure mode on (fail-open: no tenant's limits enforced) exactly when the
sidecar is busiest. A probe wakes every `PROBE_S` and notes how late it woke; while the loop is
`LATE_S` late (or the probe has not run for that long), a timed-out call is the sidecar's own
overload: it is asked again in line (`after_timeout`), then the decision refused with
`sidecar_overloaded` (503, Retry-After); nothing switches to the failure mode. New admissions
are not shed for lateness alone: a late sidecar still queues them (under 6,000 concurrent
clients, shedding at 0.5 s late refused 12 % that queueing serves, tests/test_overload.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

from admission.errors import BackendUnavailable

log = logging.getLogger(__name__)

PROBE_S = 0.02
LATE_S = 0.05  # a loop this late makes a timed-out Redis call the sidecar's overload (a
# third of the default 150 ms command timeout: a reply can wait behind loop turns that long)
WINDOW_S = 1.0  # lateness is the worst seen over about this long
RETRY_S = 0.01  # a round trip our late loop timed out: asked again after this
LOG_EVERY_S = 10.0


class LoopLag:
    def __init__(self) -> None:
        self._last = 0.0  # when the probe last ran (0: not running)
        self._worst = 0.0  # the worst lateness in the current window
        self._prev_worst = 0.0
        self._window_at = 0.0
        self._logged_at = -1e9

    async def run(self) -> None:
        """The probe, until cancelled (the server runs it beside the dispatcher)."""
        self._last = self._window_at = time.monotonic()
        while True:
            due = time.monotonic() + PROBE_S
            await asyncio.sleep(PROBE_S)
            now = time.monotonic()
            self._note(now, now - due, now)

    def _note(self, now: float, late: float, ran_at: float) -> None:
        if now - self._window_at >= WINDOW_S:
            self._prev_worst, self._worst, self._window_at = self._worst, 0.0, now
        self._worst = max(self._worst, late)
        self._last = ran_at

    def late_s(self, now: float | None = None) -> float:
        """How late the loop runs now: the worst lateness of the last window or so, or how long
        the probe has not run (0 when no probe runs: nothing is known)."""
        if not self._last:
            return 0.0
        now = time.monotonic() if now is None else now
        overdue = now - self._last - PROBE_S
        return max(self._worst, self._prev_worst, overdue, 0.0)

    def overloaded(self) -> bool:
        return self.late_s() >= LATE_S

    def timed_out(self, metrics: Any, op: str) -> None:
        """Count and log (once per `LOG_EVERY_S`) a Redis call this lateness timed out. Nothing
        switches to the failure mode."""
        metrics.overloaded.labels(op).inc()
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.warning(
                "sidecar overloaded (event loop %.0f ms late) during %s: asked again in line, "
                "then refused sidecar_overloaded; tenant limits stay enforced in Redis "
                "(no failure mode)",
                self.late_s(now) * 1000,
                op,
            )

    async def after_timeout(
        self, metrics: Any, op: str, until: float, now: float
    ) -> Literal["outage", "again", "refuse"]:
        """What a Redis call that failed calls for: "outage" — the loop was on time, so Redis
        is away (the caller's failure rule); "again" — our own lateness timed it out and
        `until` is ahead: ask it again, after `RETRY_S` (acquire.lua is idempotent per request,
        lease.lua per ticket); "refuse" — late past `until`: answer `refusal()`."""
        if not self.overloaded():
            return "outage"
        self.timed_out(metrics, op)
        if now < until:
            await asyncio.sleep(RETRY_S)
            return "again"
        return "refuse"

    @staticmethod
    def refusal() -> BackendUnavailable:
        return BackendUnavailable(
            "sidecar overloaded: retry shortly", code="sidecar_overloaded", retry_after=1
        )
