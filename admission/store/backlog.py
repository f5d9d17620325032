"""Releases and compensations that could not reach Redis, replayed in order once it answers.

A call that timed out may still have run (Redis was slow, not gone), and a release that could
not reach Redis would leave a node lease and a concurrency slot taken until their TTL: both go
here. Everything put here is idempotent (settle per ticket, ZREM of a lease), so replaying a
call whose original did run late is harmless.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from admission.metrics import Metrics
from admission.store.connection import REDIS_DOWN
from admission.store.scripts import Call, Scripts

log = logging.getLogger(__name__)


class Backlog:
    """Bounded: past `MAX` the oldest entry is dropped (counted); the TTLs in Redis free what a
    dropped entry held, later."""

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
