"""A request as routing sees it, and what it asks of a node: the prefill and KV it adds to the
node's ledger, and the limits its class must respect there. Pure: routing reads it, lease.lua
books it."""

from __future__ import annotations

from dataclasses import dataclass

from admission.scheduling.prefixes import NO_PREFIX, Prefix


@dataclass(frozen=True)
class Ask:
    """What one request would add to a node's ledger, and the limits its class must respect."""

    prompt_tokens: int  # pending prefill
    kv_tokens: int  # KV reserved until release: prompt estimate + output cap
    prefill_rate: float = 0.0  # the node's measured rate, tokens/s (0: unknown)
    prefill_budget: int = 0  # max pending prefill tokens after this one (0: not gated)
    kv_limit: int = -1  # max reserved KV tokens after this one (-1: not gated)
    urgent: bool = False  # the class admitted until drain: its KV builds the urgent reserve
    reserve_limit: int = -1  # other classes: their KV + this + the urgent reserve stay below
    urgent_waiting: int = 0  # urgent KV the caller has waiting for this node
    decode_limit_s: float = 0.0  # lower classes: the node's measured s/token must not be above
    # (0: no guard); checked by the sidecar only (gates.why_not), not sent to Redis
    prefix: Prefix = NO_PREFIX  # the prompt's head: lease.lua books what the node lacks of it
    pool_blocks: int = 0  # prefix blocks the node's KV pool keeps (0: unbounded)
    hit_tokens: int = 0  # prompt tokens this sidecar expects the node to have computed

    @property
    def prefill_tokens(self) -> int:
        """Pending prefill this request adds, as this sidecar guesses it (Redis decides)."""
        return max(0, self.prompt_tokens - self.hit_tokens)

    @property
    def new_kv(self) -> int:
        """KV this request adds to the node's booking, as this sidecar guesses it."""
        return max(0, self.kv_tokens - self.hit_tokens)


@dataclass(frozen=True, slots=True)
class Request:
    """One request as routing sees it."""

    model: str
    cls: str | None  # the class it asked for (aging moves it up the queue, not past its limits)
    prompt: int  # prompt tokens
    kv: int  # KV it books: the prompt and the answer its tenant's answers run to
    tenant: str | None = None
    prefix: Prefix = NO_PREFIX  # the prompt's head (prefixes.py)
    waited_s: float = 0.0  # how long it has waited here (counted while its class is late)
