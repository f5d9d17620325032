"""One request as the benchmark's client saw it (`Record`), the refusals a policy answers on
purpose (`POLICY_CODES`), and the one percentile every figure of loadtest/ uses. Pure.

A record is "lost" when the client got no answer, a reset, or a 5xx that the policy did not
produce (the policy's own refusals are 429s and 503s with a named `error.code`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

POLICY_CODES = {
    "queue_timeout",
    "queue_full",
    "limiter_unavailable",
    "admission_unavailable",
    "requests_per_s",
    "tokens_per_min",
    "burst",
    "concurrency",
    "request_exceeds_limit",
    "slo_unreachable",
    "over_fair_share",
    "engine_refused",
}


@dataclass
class Record:
    system: str
    kind: str
    tenant: str
    cls: str
    sent_s: float
    status: int  # 0: no answer (connection error, reset, timeout)
    code: str = ""  # error.code of a refusal
    ttft_s: float | None = None
    e2e_s: float | None = None
    completion_tokens: int = 0
    late_s: float = 0.0  # how late the generator sent it
    asked_tokens: int = 0  # the request's max_tokens: what it would have produced if served
    prompt_tokens: int = 0  # the engine's usage: the prompt as its tokenizer counts it
    cached_tokens: int = -1  # of those, what its prefix cache held (-1: not reported)
    conversation: str = ""  # the conversation it is a turn of ("": none)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (None: fewer than two tokens)."""
        if not self.ok or self.e2e_s is None or self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def lost(self) -> bool:
        if self.status == 0:
            return True
        return self.status >= 500 and self.code not in POLICY_CODES


def percentile(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100); NaN for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return s[k]
