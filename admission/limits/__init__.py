"""Tenant limits: Redis token buckets and the sliding-window guard (acquire/settle), and the
local buckets that stand in for them under fail-open."""

from admission.limits.args import Rates
from admission.limits.buckets import Acquired, Limiter
from admission.limits.local import LocalBucket, LocalLimits

__all__ = ["Acquired", "Limiter", "LocalBucket", "LocalLimits", "Rates"]
