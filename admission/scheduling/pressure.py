"""Memory-aware limits: while every live node serving a model is held (memory at its
watermarks) for `watermarks.tighten_after_s`, lower classes' refill rates are multiplied by
`watermarks.tighten_factor` until a node opens again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from admission.metrics import Metrics
from admission.policy import Policy

log = logging.getLogger(__name__)


class Pressure:
    """Per model, since when every live node serving it has been held, and the factor that
    puts on the limits (`limit_factor`; admission_limit_factor{model})."""

    def __init__(
        self, policy: Callable[[], Policy], metrics: Metrics, clock: Callable[[], float]
    ) -> None:
        self.policy, self.metrics, self.clock = policy, metrics, clock
        self.held_since: dict[str, float] = {}  # model → since when every live node is held

    def held(self, model: str, all_held: bool, now: float) -> None:
        """A node of `model` moved: whether every live node serving it is held now."""
        if all_held:
            self.held_since.setdefault(model, now)
        elif self.held_since.pop(model, None) is not None:
            log.info("model %s: a node opened again; limits back to normal", model)

    def limit_factor(self, model: str, cls: str | None = None) -> float:
        """The factor on the refill rates of `cls` for `model` (1.0: normal). The most urgent
        class is never tightened (None: the factor for the classes below it)."""
        policy = self.policy()
        wm = policy.watermarks
        since = self.held_since.get(model)
        if since is None or wm.tighten_factor >= 1.0 or cls == next(iter(policy.classes)):
            return 1.0
        return wm.tighten_factor if self.clock() - since >= wm.tighten_after_s else 1.0

    def gauge(self) -> None:
        for model in self.policy().models():
            self.metrics.limit_factor.labels(model).set(self.limit_factor(model))

    def snapshot(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [
            {"model": m, "held_for_s": round(now - since, 1), "factor": self.limit_factor(m)}
            for m, since in sorted(self.held_since.items())
        ]
