"""The dispatcher's loop: node views read every `REFRESH_S`, and the queue dispatched after each
read (and when a request queues).

Reads and passes stay in one loop, a pass as long as it admits. Under load (8 sidecars, 3 Redis
masters and the load on 2 cores) one pass ran 7.4 s, its leases refused one by one by nodes
that other sidecars had filled, with no read in between (tests/test_many_sidecars.py). Two
remedies were tried and not kept (docs/scaling.md): the reads as a task of their own, and a
pass ended after 0.1 s. With either, llmd 1.5× (seed 7) refused realtime late in some runs
(84, 14 and 65 requests; 3 of 8 runs) where this loop refused none in 8 — the urgent class's
own guard feeding on its refusals, since fixed (gates.slow_decode); tried again after that
fix, the reads as a task saw a drain under load no sooner than this loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from admission.metrics import Metrics
from admission.scheduling.nodetable import NodeTable
from admission.scheduling.queue import FairQueue
from admission.scheduling.take_lease import Placer

log = logging.getLogger(__name__)

REFRESH_S = 0.1  # node-state poll period while requests flow: a fraction of the agents' period
IDLE_REFRESH_S = 0.5  # ... and while none has (idle CPU); a decision reads first if > 0.2 s


@dataclass
class Loop:
    """The dispatcher's loop, given what it uses: the node table it refreshes, the placer whose
    activity sets the pace, the queue it waits on, the pass it runs and the event that wakes
    it (a request queued, a lease given back)."""

    clock: Callable[[], float]
    metrics: Metrics
    nodes: NodeTable
    place: Placer
    queue: FairQueue
    dispatch: Callable[[], Awaitable[int]]
    wake: asyncio.Event
    refreshed: Callable[[float], None] = lambda _now: None  # after each refresh (the demand)

    async def run(self) -> None:
        """Refresh node views and dispatch, until cancelled. An unexpected error is logged and
        the loop goes on: a dead dispatcher would leave every queued request to time out."""
        next_refresh = 0.0
        while True:
            try:
                now = self.clock()
                self.metrics.held_recent.tick(now)
                if now >= next_refresh:
                    await self.nodes.refresh()
                    self.refreshed(now)
                    idle = not (self.place.active or len(self.queue))
                    next_refresh = now + (IDLE_REFRESH_S if idle else REFRESH_S)
                    self.place.active = False
                started = time.process_time()
                await self.dispatch()
                self.metrics.dispatch_seconds.observe(time.process_time() - started)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("dispatcher step failed; continuing")
                self.metrics.redis_errors.labels("dispatch").inc()
            self.wake.clear()
            wait = REFRESH_S if len(self.queue) else max(0.0, next_refresh - self.clock())
            try:
                await asyncio.wait_for(self.wake.wait(), wait)
            except TimeoutError:
                pass
