"""How many batch lines a worker keeps in flight: as many as the cluster has idle capacity for.

A fixed number is wrong both ways: 16 lines in flight cost realtime traffic 1.3 points of its
TTFT target on two busy nodes, 4 leave realtime untouched but take three times as long on an
idle cluster. `Pace` follows the cluster instead, the way TCP Vegas follows a path: it keeps the
lowest time per output token a line has shown lately (the cluster with room to spare) and, from
the recent average, estimates how many of its own lines are waiting rather than running —
`limit × (1 − base / recent)`. Fewer than `alpha` waiting: one more line per round; more than
`beta`: one fewer per round; a refusal (429, 503, no answer): half as many at once. Lines of the
batch class queue behind realtime in the sidecar and share engine steps with it, so when
realtime gets busy their latency rises and the worker backs off before realtime pays for it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

BACKOFF = (0, 429, 502, 503, 504)


class Pace:
    def __init__(
        self,
        ceiling: int,
        floor: int = 1,
        start: float = 2.0,
        alpha: float = 1.0,
        beta: float = 2.0,
        base_window_s: float = 150.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ceiling, self.floor = max(1, ceiling), max(1, min(floor, ceiling))
        self.limit = min(float(self.ceiling), max(float(self.floor), start))
        self.alpha, self.beta = alpha, beta
        self.window = base_window_s
        self.clock = clock
        self._base = (math.inf, math.inf)  # lowest seconds per token: this window, the last one
        self._since = clock()
        self._avg = 0.0
        self._cut_at = -math.inf

    def allowed(self) -> int:
        return int(self.limit)

    def sample(self, seconds: float, tokens: int, status: int) -> None:
        """One attempt at a line ended: its time, the output tokens it got, its HTTP status."""
        now = self.clock()
        if status in BACKOFF:
            if now - self._cut_at >= 1.0:  # one cut per burst of refusals
                self.limit = max(float(self.floor), self.limit / 2)
                self._cut_at = now
            return
        if status != 200 or tokens <= 0:
            return
        x = seconds / tokens
        if now - self._since >= self.window:
            self._base = (math.inf, self._base[0])
            self._since = now
        self._base = (min(self._base[0], x), self._base[1])
        base = min(self._base)
        self._avg = x if self._avg == 0.0 else self._avg + 0.2 * (x - self._avg)
        waiting = self.limit * (1.0 - base / self._avg)
        if waiting < self.alpha:
            self.limit = min(float(self.ceiling), self.limit + 1.0 / self.limit)
        elif waiting > self.beta:
            self.limit = max(float(self.floor), self.limit - 1.0 / self.limit)
