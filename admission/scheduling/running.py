"""The dispatcher's loop: node views read every `REFRESH_S`, and the queue dispatched after each
read (and when a request queues).

Reads and passes stay in one loop, a pass as long as it admits. Under load (8 sidecars, 3 Redis
masters and the load on 2 cores) one pass ran 7.4 s, its leases refused one by one by nodes
that other sidecars had filled, with no read in between (tests/test_many_sidecars.py). Two
remedies were tried and not kept (docs/scaling.md): the reads as a task of their own, and a
pass ended after 0.1 s. With either, llmd 1.5× (seed 7) refused realtime late in some runs
(84, 14 and 65 requests; 3 of 8 runs) where this loop refused none in 8 — the urgent class's
own guard feeding on its refusals, since fixed (routing.slow_decode); tried again after that
fix, the reads as a task saw a drain under load no sooner than this loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from admission.scheduling.dispatcher import Dispatcher

log = logging.getLogger(__name__)

REFRESH_S = 0.1  # node-state poll period while requests flow: a fraction of the agents' period
IDLE_REFRESH_S = 0.5  # ... and while none has (idle CPU); a decision reads first if > 0.2 s


async def run(d: Dispatcher) -> None:
    """Refresh node views and dispatch, until cancelled. An unexpected error is logged and the
    loop goes on: a dead dispatcher would leave every queued request to time out."""
    next_refresh = 0.0
    while True:
        try:
            now = d.clock()
            d.metrics.held_recent.tick(now)
            if now >= next_refresh:
                await d.nodes.refresh()
                idle = not (d.place.active or len(d.queue))
                next_refresh = now + (IDLE_REFRESH_S if idle else REFRESH_S)
                d.place.active = False
            started = time.process_time()
            await d.dispatch()
            d.metrics.dispatch_seconds.observe(time.process_time() - started)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("dispatcher step failed; continuing")
            d.metrics.redis_errors.labels("dispatch").inc()
        d.wake.clear()
        wait = REFRESH_S if len(d.queue) else max(0.0, next_refresh - d.clock())
        try:
            await asyncio.wait_for(d.wake.wait(), wait)
        except TimeoutError:
            pass
