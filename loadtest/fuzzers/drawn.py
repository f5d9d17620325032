"""How every fuzzer runs hypothesis: a fixed number of drawn cases, no deadline, no example
database, every health check off (the cases go through real processes, slow by design), and
the same draw again for a given seed."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, Phase, settings


def cases(n_cases: int, seed: int | None = None, shrink: bool = True) -> Any:
    """hypothesis `settings` for `n_cases` drawn cases (`shrink` False: generate only)."""
    return settings(
        max_examples=n_cases,
        deadline=None,
        database=None,
        derandomize=seed is not None,
        suppress_health_check=list(HealthCheck),
        **({} if shrink else {"phases": [Phase.generate]}),
    )
