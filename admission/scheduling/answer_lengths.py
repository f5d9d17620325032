"""How long the urgent class's answers really are, and the decode speed that its targets ask.

The decode guard holds lower classes off a node whose measured time per output token is above
what the most urgent class may see. Its `slo.tpot_ms` alone assumes answers short enough for
its `slo.e2e_ms`; with longer answers (agents, tool calls: hundreds of tokens) a request can meet
tpot_ms and still miss e2e_ms. So the guard's limit is the tighter of tpot_ms and
(e2e_ms − ttft_ms) ÷ the mean output of the urgent class's recent answers, learned from the
edge's releases (the engine's own `usage.completion_tokens`, not the client's `max_tokens` cap,
which is often generous) — never below half of tpot_ms: a target that asks more of decode than
that is not one lower classes could buy back by waiting, and they must not starve for it.

What is learned cannot be steered by the tenant it describes, nor by another: only answers that
ended on their own teach what a request books (`finish` "stop": one cut at its cap by
`max_tokens: 1` is a lower bound, not a length), and a request books at least FLOOR of its cap
whatever its tenant's answers ran to; the guard's mean counts every answer (a cut one was
decoded that long) but is each tenant's own mean combined by the tenants' weights, so one
tenant moves it at most by its weight's share of the tenants answering.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from admission.policy import Policy

MAX_OPEN = 10_000  # urgent tickets remembered until their release (a release may go elsewhere)
ALPHA = 0.05  # EWMA weight of one answer (≈ the last 20–40 answers)
# What a request books for its answer (KV, in the node ledger): not the client's max_tokens, which
# is a cap — most clients send a generous one, or none and get edge.default_max_tokens —, but
# the most its tenant's answers of the class lately ran to: a high quantile of the engine's
# usage.completion_tokens over the last ANSWERS releases, and the cap itself until MIN_ANSWERS
# came back. vLLM takes an answer's KV as it is generated, never the cap: booking the cap held
# nodes at the watermarks with their real memory a fraction of it (docs/benchmarks.md).
ANSWERS = 200
MIN_ANSWERS = 20
QUANTILE = 0.98
MAX_KEYS = 10_000  # (model, class, tenant) keys remembered, least recently answered out first
RESORT = 8  # with a full window, its quantile is taken again every this many answers
# The least of its cap a request books for its answer, whatever its tenant's answers ran to: a
# tenant that ends answers early on purpose (stop strings) books long ones at most 16× short.
FLOOR = 1 / 16
# How an answer ended, as the edge reports it (the engine's finish_reason): these ended on their
# own; "length" (cut at max_tokens) and an unknown end teach no length.
NATURAL = frozenset({"stop", "tool_calls", "function_call"})
MAX_TENANTS = 10_000  # tenants whose urgent mean is kept, least recently answered out first


@dataclass
class _Window:
    """One (model, class, tenant)'s recent answer lengths and their QUANTILE (0: too few)."""

    lengths: deque[int] = field(default_factory=lambda: deque(maxlen=ANSWERS))
    high: int = 0
    since: int = 0  # answers since `high` was taken

    def add(self, n: int) -> None:
        self.lengths.append(n)
        self.since += 1
        # Taken again every RESORT answers once the window is full (a sort of ANSWERS), at each
        # answer before.
        if len(self.lengths) >= MIN_ANSWERS and (
            len(self.lengths) < ANSWERS or self.since >= RESORT
        ):
            ordered = sorted(self.lengths)
            self.high = ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]
            self.since = 0


class AnswerLengths:
    """How long answers are, from the engine's usage at release: the mean of the urgent class's
    (the decode guard) and, per model, class and tenant, the recent lengths a request books KV
    for (`answer_kv`). From every release this sidecar receives (the edge spreads releases over
    the sidecars: each learns from a sample), whichever sidecar admitted the request."""

    def __init__(self, weight_of: Callable[[str], float] = lambda _t: 1.0) -> None:
        # ticket → (urgent, (model, class, tenant)) of requests admitted here, until released
        self._open: OrderedDict[str, tuple[bool, tuple[str, str, str]]] = OrderedDict()
        self.weight_of = weight_of  # a tenant's weight in the policy (the decode guard's mean)
        # tenant → (its urgent answers' EWMA, its weight when last answered), and their sums
        self._means: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._weights = self._weighted = 0.0
        # (model, class, tenant) → its answers, the most recently answered last
        self._windows: OrderedDict[tuple[str, str, str], _Window] = OrderedDict()

    def admitted(
        self, ticket: str, urgent: bool, model: str = "", cls: str = "", tenant: str = ""
    ) -> None:
        """A request sent to a node: its answer's length is learned at its release (the urgent
        class's mean, and every class's answer lengths per tenant)."""
        self._open[ticket] = (urgent, (model, cls, tenant))
        if len(self._open) > MAX_OPEN:
            self._open.popitem(last=False)  # its release went to another sidecar, or was lost

    @property
    def mean(self) -> float:
        """The urgent class's mean answer length (0: nothing learned yet): each tenant's own
        mean, weighted by its weight in the policy (as of its last answer: a reweighting shows
        at the tenant's next one). Read by every routing decision: kept as two running sums."""
        return self._weighted / self._weights if self._weights > 0 else 0.0

    def answered(
        self,
        ticket: str,
        completion_tokens: int,
        elsewhere: tuple[bool, tuple[str, str, str]] | None = None,
        finish: str | None = "stop",
    ) -> None:
        """A release; `completion_tokens` < 0: the engine reported no usage (not counted).
        `elsewhere`: (urgent, (model, class, tenant)) as the edge's release names them, for a
        request another sidecar admitted: the edge spreads releases over the sidecars, so of
        k sidecars each would otherwise learn from 1/k² of the answers instead of 1/k.
        `finish`: how the answer ended; only one in NATURAL teaches what requests book."""
        opened = self._open.pop(ticket, None) or elsewhere
        if opened is None or completion_tokens < 0:
            return
        urgent, key = opened
        if urgent:
            n, tenant = float(completion_tokens), key[2]
            old = self._forget(tenant)
            m, w = (n if old is None else ALPHA * n + (1 - ALPHA) * old), self.weight_of(tenant)
            self._means[tenant] = (m, w)
            self._weights, self._weighted = self._weights + w, self._weighted + w * m
            if len(self._means) > MAX_TENANTS:
                self._forget(next(iter(self._means)))
        if finish not in NATURAL:
            return
        window = self._windows.pop(key, None) or _Window()
        self._windows[key] = window
        window.add(completion_tokens)
        if len(self._windows) > MAX_KEYS:
            self._windows.popitem(last=False)

    def _forget(self, tenant: str) -> float | None:
        """Take a tenant's mean out of the sums; the mean, or None if it had none."""
        old = self._means.pop(tenant, None)
        if old is None:
            return None
        m, w = old
        self._weights, self._weighted = max(0.0, self._weights - w), self._weighted - w * m
        if not self._means:
            self._weights = self._weighted = 0.0  # no float residue once empty
        return m

    def booked_answers(self, most: int = 50) -> list[dict[str, object]]:
        """For the status page: the answer lengths requests book now (`tokens`; None: still
        their cap, fewer than MIN_ANSWERS known) and how many answers that is learned from,
        the most recently answered (model, class, tenant) first."""
        return [
            {
                "model": m,
                "class": c,
                "tenant": t,
                "tokens": w.high or None,
                "answers": len(w.lengths),
            }
            for (m, c, t), w in islice(reversed(self._windows.items()), most)
        ]

    def answer_kv(self, model: str, cls: str, tenant: str, cap: int) -> int:
        """Output tokens a request books KV for: `cap` (its max_tokens), or less once its
        tenant's answers of the class are known to stop short of it (ANSWERS), never under
        FLOOR of the cap."""
        window = self._windows.get((model, cls, tenant))
        if not window or not window.high:
            return cap
        return min(cap, max(1, window.high, math.ceil(cap * FLOOR)))


def decode_limit_s(policy: Policy, mean_output: float = 0.0) -> float | None:
    """Seconds per output token above which lower classes stay off a node (None: no guard):
    the most urgent class's slo.tpot_ms, tightened to what its e2e_ms asks of answers of
    `mean_output` tokens, never below half of tpot_ms."""
    for c in policy.classes.values():
        if not c.slo_tpot_ms:
            continue
        tpot = c.slo_tpot_ms / 1000
        if c.slo_e2e_ms and mean_output > 0:
            e2e = (c.slo_e2e_ms - (c.slo_ttft_ms or 0)) / 1000 / mean_output
            return max(tpot / 2, min(tpot, e2e))
        return tpot
    return None


def own_decode_limit_s(policy: Policy, cls: str, mean_output: float) -> float | None:
    """Seconds per output token above which the urgent class itself waits for a node (None: it
    never does): only a class that refuses late (`on_late: refuse`: it would rather be answered
    early than run past its target) with an end-to-end target, once its answers' length is
    known; routing applies it while the class is being refused late (`overload.Overload.late`:
    past what any order serves), not before. The looser of its tpot_ms and what its e2e_ms
    asks of answers of `mean_output` tokens: past both, a request sent there finishes late
    whatever it does, and the decode it joins slows every request already running — under
    overload it is refused early instead."""
    c = policy.classes.get(cls)
    if c is None or not c.refuses_late or not c.slo_e2e_ms or mean_output <= 0:
        return None
    e2e = (c.slo_e2e_ms - (c.slo_ttft_ms or 0)) / 1000 / mean_output
    return max(e2e, (c.slo_tpot_ms or 0) / 1000)
