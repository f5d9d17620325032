"""The `priority` a request carries into vLLM (lower runs earlier). Pure.

vLLM's priority scheduling orders its waiting queue by (priority, arrival). The sidecar sends
the class's priority scaled by SIZE_BANDS, plus the request's size band: within a class, the
engine starts the prompt with less to compute first. A prompt whose prefix the node holds
needs a fraction of a cold one's prefill; queued behind a cold one, its first token is late
too (the llm-d-like mix's start: docs/benchmarks.md). Shortest first maximises how many first
tokens are in time; it cannot starve a long prompt for long, because the sidecar keeps what a
node has waiting to what clears within the target TTFT (routing.py's prefill budget).
"""

from __future__ import annotations

from admission.policy import Node, Policy

SIZE_BANDS = 16  # bands per class: the class's priority × SIZE_BANDS + the band
_SMALLEST = 8  # band 0: fewer than 2**8 tokens to compute; each band after doubles


def size_band(prefill_tokens: int) -> int:
    """0 to SIZE_BANDS - 1: the power of two of the prompt tokens the node must compute (the
    prompt less what this sidecar expects it to hold cached), so that prompts of like size keep
    their arrival order."""
    return min(SIZE_BANDS - 1, max(0, max(0, prefill_tokens).bit_length() - _SMALLEST))


def engine_priority(
    policy: Policy,
    requested_cls: str | None,
    cls: str,
    tenant: str,
    node: Node,
    prefill_tokens: int = 0,
) -> int:
    """vLLM's `priority` for a request: its class's, scaled, plus its size band.

    The class is the less urgent of the class asked for and the class it is in now. Aging moves
    a request up the *queue* only: a promoted batch request must not compete with realtime
    inside the engine; a long request demoted by `long_request_tokens` runs at the lower class
    there too. On a pool's node lent to another tenant, behind every class of the owners: they
    take their capacity back inside the engine at once (vLLM schedules them first and preempts,
    it does not kill)."""
    classes = policy.classes
    asked = [n for n in (requested_cls, cls) if n is not None]
    prio = max((c.priority for n in asked if (c := classes.get(n))), default=0)
    if node.pool is not None and policy.tenant_pool.get(tenant) != node.pool:
        levels = [c.priority for c in classes.values()]
        prio += 1 + max(levels) - min(levels)
    return prio * SIZE_BANDS + size_band(prefill_tokens)
