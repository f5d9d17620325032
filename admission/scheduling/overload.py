"""Overload: when a class of a model is past capacity, and what the sidecar does then. Pure.

The one place that answers it. One state per (model, class), from two marks this sidecar makes,
read at the `now` every caller passes (the dispatcher's clock; no timer of its own):

               arrival finds no node               refused late
    WITHIN ───────────────────────────▶ SHORT ─────────────────────▶ SHEDDING
      │                                                                 ▲
      │ refused late                          arrival finds no node    │
      └──────────────────────────────▶ LATE ────────────────────────────┘
    Each mark runs out on its own clock, and the state falls back with it: `late` REFUSING_S
    (5 s) after the last late refusal; `short` YOUNG_S (1 s) after the last arrival that found
    no node, FULL_S (5 s) once that spell lasted CONFIRM_S (2 s).

- `late`: a request of the class was refused late (`on_late: refuse`: its wait made its TTFT
  target unreachable, late_heads.py) or waited past the nearly-late point, or was refused early
  (a shed arrival would have been refused late): no order serves it all. Routing then applies
  the urgent class's own decode guard and gives it only what is left of its target as prefill
  budget (gates.py); lower SLO classes under their `min_share` pass the decode guard (`owed`).
- `short`: arrivals of the class find no node with room (they queue).
- both (SHEDDING): arrivals of tenants above their weight's fair rate are refused at once, 429
  `over_fair_share` (shedding.py) — spreading refusals by weight, not by arrival order.

What is marked is keyed by the policy's models and classes only: bounded by the policy.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable

from admission.policy import Policy

# A class refused a request late this recently is past what any order serves (`late`).
REFUSING_S = 5.0
# A request of the class found no node this recently: still short of nodes. One averaging time
# of the fair-rate estimates (shedding.TAU_S): shedding well, the passed load sits just under
# what the nodes take, so spells of a second or two where every arrival finds a node are normal;
# at 1 s each such spell let every tenant in alike (support 2.0× / conversations, four paired
# runs: served shares 1.3–3.1 points nearer the fair ones with 5 s; docs/benchmarks.md).
FULL_S = 5.0
# ... once the arrivals have found no node over CONFIRM_S: a younger spell of full arrivals ends
# YOUNG_S after its last. A stall of the host (the ledger's pending prefill ahead of the node for
# a moment) queues a few requests and can refuse one late; with FULL_S from the first mark, the
# early refusals went on for 5 s after on a node with room (tests/test_fairness.py's shipped
# defaults beside other tests: 264–690 refused in 5 s). An overload queues for longer than
# CONFIRM_S before its first late refusal, so its spell is confirmed by then.
CONFIRM_S = 2.0
YOUNG_S = 1.0

Key = tuple[str, str]  # (model, class)


class State(enum.Enum):
    WITHIN = "within"  # nothing marked
    SHORT = "short"  # arrivals find no node; nothing refused late
    LATE = "late"  # refused late lately; arrivals find nodes
    SHEDDING = "shedding"  # both: arrivals above a tenant's fair share are refused early


class Overload:
    """The marks of every (model, class) and the state they make at a given `now`."""

    def __init__(self) -> None:
        self._late: dict[Key, float] = {}  # when it was last refused late (or nearly)
        self._short: dict[Key, float] = {}  # when an arrival last found no node
        self._since: dict[Key, float] = {}  # the first such arrival of the current spell

    # -- marks ----------------------------------------------------------------------------------
    def refused_late(self, model: str, cls: str, now: float) -> None:
        """A request of the class was refused late, nearly late, or early (see the module)."""
        self._late[(model, cls)] = now

    def no_node(self, model: str, cls: str, now: float) -> None:
        """An arrival of the class found no node with room (it queues)."""
        if not self.short(model, cls, now):
            self._since[(model, cls)] = now  # a new spell of arrivals that find no node
        self._short[(model, cls)] = now

    # -- reads ----------------------------------------------------------------------------------
    def late(self, model: str, cls: str | None, now: float) -> bool:
        """Refused late within the last REFUSING_S seconds."""
        return cls is not None and now - self._late.get((model, cls), -math.inf) < REFUSING_S

    def short(self, model: str, cls: str, now: float) -> bool:
        """Still short of nodes: a shed arrival would not have found one. Runs out once nodes
        have had room on arrival for FULL_S — YOUNG_S while the spell is younger than CONFIRM_S."""
        last = self._short.get((model, cls), -math.inf)
        confirmed = last - self._since.get((model, cls), last) >= CONFIRM_S
        return now - last < (FULL_S if confirmed else YOUNG_S)

    def state(self, model: str, cls: str, now: float) -> State:
        late, short = self.late(model, cls, now), self.short(model, cls, now)
        if late:
            return State.SHEDDING if short else State.LATE
        return State.SHORT if short else State.WITHIN

    def owed(
        self,
        policy: Policy,
        model: str,
        cls: str,
        now: float,
        share: Callable[[str, str, float], float],
    ) -> bool:
        """Whether the decode guard lets `cls` through for `model` now: an urgent class is late
        (past what any order serves) and `cls` got less than its `min_share` of the model's
        tokens lately (`share(model, cls, now)`: shedding.FairShed.class_share). A lower class with an SLO
        only: one without gets its min_share from the queue's order while an SLO class waits,
        and has no first token to be late for."""
        c = policy.classes.get(cls)
        if c is None or not c.slo_ttft_ms or c.min_share <= 0 or policy.is_urgent(cls):
            return False
        if not any(self.late(model, u, now) for u in policy.classes if policy.is_urgent(u)):
            return False
        return share(model, cls, now) < c.min_share

    def snapshot(self, now: float) -> list[dict[str, str]]:
        """For the status page: every (model, class) not WITHIN now."""
        keys = sorted(set(self._late) | set(self._short))
        states = ((m, c, self.state(m, c, now)) for m, c in keys)
        return [
            {"model": m, "class": c, "state": s.value} for m, c, s in states if s != State.WITHIN
        ]
