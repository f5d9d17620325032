"""The dispatcher's two loops, as separate tasks: node views read every `REFRESH_S`, and the
queue dispatched in passes of at most `DISPATCH_SLICE_S`.

Separate, because a pass's lease round trips can be slow: under load (8 sidecars, 3 Redis
masters and the load on 2 cores) one pass ran 7 s, its leases refused one by one by nodes that
other sidecars had filled, and with the reads behind it in one loop no drain was seen for that
long (tests/test_many_sidecars.py). Reads and passes overlap safely: a view that moves under a
pass costs a refused lease, never a wrong booking (lease.lua decides). The slice is for what
runs at a pass's start: the late check (late.py) and aging.
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
DISPATCH_SLICE_S = REFRESH_S  # one pass admits for at most this long, then starts again


async def run(d: Dispatcher) -> None:
    """Read and dispatch until cancelled."""
    reads = asyncio.create_task(poll(d), name="node-reads")
    try:
        await dispatch(d)
    finally:
        reads.cancel()
        await asyncio.gather(reads, return_exceptions=True)


async def poll(d: Dispatcher) -> None:
    """Refresh the node views, each `REFRESH_S` while requests flow, and wake the dispatcher
    when work waits. An unexpected error is logged and the loop goes on."""
    while True:
        started = d.clock()
        try:
            await d.nodes.refresh()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("node refresh failed; continuing")
            d.metrics.redis_errors.labels("refresh").inc()
        busy = d.place.active or d.passing or len(d.queue) > 0  # (a pass holds what it leases)
        d.place.active = False
        if len(d.queue):
            d.wake.set()  # the views moved: room may have opened
        period, took = REFRESH_S if busy else IDLE_REFRESH_S, d.clock() - started
        # A slow read (Redis or this process overloaded) is followed by a pause, not at once
        # by the next: under overload the reads take at most about half of the time.
        await asyncio.sleep(max(period - took, min(took, period)))


async def dispatch(d: Dispatcher) -> None:
    """Dispatch when woken (a request queued, the views read) or every `REFRESH_S` while work
    waits; at once after a pass that ran out of its slice. An unexpected error is logged and the
    loop goes on: a dead dispatcher would leave every queued request to time out."""
    while True:
        try:
            started, d.passing = time.process_time(), True
            await d.dispatch()
            d.metrics.dispatch_seconds.observe(time.process_time() - started)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("dispatcher step failed; continuing")
            d.metrics.redis_errors.labels("dispatch").inc()
        finally:
            d.passing = False
        d.wake.clear()
        if d.cut:  # work left: the next pass at once (the reads run beside it)
            await asyncio.sleep(0)
            continue
        try:
            await asyncio.wait_for(d.wake.wait(), REFRESH_S if len(d.queue) else IDLE_REFRESH_S)
        except TimeoutError:
            pass
