"""Scheduling: the weighted-fair queue, node views and routing, leases and tickets, and the
dispatcher that owns the admit decision (fast path, queue, undo).

The face imports nothing eagerly: `import admission.scheduling.queue` loads the queue and what
it needs, not the dispatcher with Redis and asyncio behind it (tests/test_layout.py). The names
below load their module on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from admission.scheduling.dispatcher import Dispatcher
    from admission.scheduling.queue import FairQueue, Item
    from admission.scheduling.take_lease import Admission

_FROM = {
    "Admission": "admission.scheduling.take_lease",
    "Dispatcher": "admission.scheduling.dispatcher",
    "FairQueue": "admission.scheduling.queue",
    "Item": "admission.scheduling.queue",
}
__all__ = ["Admission", "Dispatcher", "FairQueue", "Item"]


def __getattr__(name: str) -> Any:
    if name in _FROM:
        return getattr(import_module(_FROM[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
