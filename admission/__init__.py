"""GPU-aware admission control for multi-tenant LLM inference behind NGINX.

Public surface: the policy loader and the error hierarchy. Everything else is reached through
the `admission` command (see `admission.cli`).
"""

from admission.errors import (
    AdmissionError,
    BackendUnavailable,
    BadRequest,
    PolicyError,
    QueueFull,
    QueueTimeout,
    Throttled,
)
from admission.policy import Policy, load_policy, parse_policy

__all__ = [
    "AdmissionError",
    "BackendUnavailable",
    "BadRequest",
    "Policy",
    "PolicyError",
    "QueueFull",
    "QueueTimeout",
    "Throttled",
    "load_policy",
    "parse_policy",
]
