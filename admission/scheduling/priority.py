"""The `priority` a request carries into vLLM (lower runs earlier). Pure.

vLLM's priority scheduling orders its waiting queue by (priority, arrival). The sidecar sends
the class's priority times BANDS plus the request's band: within a class, a prompt the node
mostly holds in its prefix cache starts before one it must compute. Such a prompt needs a
fraction of a cold one's prefill; queued behind a cold one, its first token was late too (the
llm-d-like mix: ~1,000 tokens to compute against ~7,000; docs/benchmarks.md). Putting it first
costs the cold one only that fraction.

Only the cache decides, not the prompt's size: the prefill budget admits work in arrival order
(what a node has waiting clears within the target TTFT, gates.py), so among prompts the node
must compute, arrival order is the order that keeps every admitted first token in time.
Shortest first among them put the longest prompts of a RAG mix past their target (tried:
docs/benchmarks.md).
"""

from __future__ import annotations

from admission.policy import Node, Policy

BANDS = 2  # per class: 0, the node holds most of the prompt; 1, it must compute most of it
HELD = 0.75  # the share of the prompt the node holds that makes a prompt "held" (band 0)


def band(prompt_tokens: int, prefill_tokens: int) -> int:
    """0 when the node is expected to hold at least HELD of the prompt (it computes the rest:
    `prefill_tokens`, as this sidecar guesses it); 1 otherwise, and for a prompt with nothing
    cached, whatever its length."""
    held = prompt_tokens - prefill_tokens
    return 0 if prompt_tokens > 0 and held >= HELD * prompt_tokens else 1


def engine_priority(
    policy: Policy,
    requested_cls: str | None,
    cls: str,
    tenant: str,
    node: Node,
    prompt_tokens: int = 0,
    prefill_tokens: int = 0,
) -> int:
    """vLLM's `priority` for a request: its class's times BANDS, plus its band.

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
    return prio * BANDS + band(prompt_tokens, prefill_tokens)
