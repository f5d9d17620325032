"""Scheduling: the weighted-fair queue, node views and routing, leases and tickets, and the
dispatcher that owns the admit decision (fast path, queue, undo)."""

from admission.scheduling.dispatcher import Dispatcher
from admission.scheduling.placing import Admission
from admission.scheduling.queue import FairQueue, Item

__all__ = ["Admission", "Dispatcher", "FairQueue", "Item"]
