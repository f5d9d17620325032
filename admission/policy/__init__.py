"""The policy: what an SRE writes in policies.yaml, as frozen dataclasses, and its loader. Pure."""

from admission.policy.load import load_policy, parse_policy
from admission.policy.model import (
    AdmitUntil,
    BatchSettings,
    ClassPolicy,
    EdgeSettings,
    FailureMode,
    Limits,
    MemorySource,
    Node,
    OnLate,
    Policy,
    Pool,
    QueueSettings,
    RedisSettings,
    Tenant,
    Watermarks,
    digest_key,
)

__all__ = [
    "AdmitUntil",
    "BatchSettings",
    "ClassPolicy",
    "EdgeSettings",
    "FailureMode",
    "Limits",
    "MemorySource",
    "Node",
    "OnLate",
    "Policy",
    "Pool",
    "QueueSettings",
    "RedisSettings",
    "Tenant",
    "Watermarks",
    "digest_key",
    "load_policy",
    "parse_policy",
]
