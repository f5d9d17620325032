"""Keys an older policies.yaml may still carry: named as removed, with what replaced them."""

from __future__ import annotations

from typing import Any

from admission.policy.checks import Checker

_REMOVED = {
    "watermarks.projection_window_s": "removed: each node's ledger in Redis (KV reserved at "
    "dispatch, cleared at release) replaced the time window; delete the key",
    "watermarks.max_engine_waiting": "removed: the prefill budget (pending prefill within what "
    "the node clears in the target TTFT, from its measured rate) replaced it; delete the key",
}


def removed(c: Checker, m: dict[Any, Any], section: str) -> dict[Any, Any]:
    """Report removed keys (with their replacement) and drop them, so they are not also
    reported as unknown."""
    out = dict(m)
    for key in list(out):
        why = _REMOVED.get(f"{section}.{key}")
        if why:
            c.err(f"{section}.{key}", why)
            del out[key]
    return out
