"""What every fuzzed answer must be, for every fuzzer that goes through the edge: a fuzzed
request (`Case`), the answers counted (`Tally`), and the check of one answer (`check`): JSON in
OpenAI's shape, a 5xx only where the failure modes define one, never the key echoed back."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

# 5xx an edge may answer, each documented in the failure modes (docs/operations.md).
DEFINED_5XX = {
    "admission_unavailable",
    "limiter_unavailable",
    "admission_busy",
    "sidecar_overloaded",
    "queue_timeout",
    "no_capacity",
    "engine_unavailable",
    "engine_timeout",
}


@dataclass(frozen=True)
class Case:
    path: str
    raw: bytes
    headers: dict[str, str]


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    secrets_sent: set[str] = field(default_factory=set)
    slowest: tuple[float, str] = (0.0, "")

    @property
    def cases(self) -> int:
        return sum(self.statuses.values())

    def answered(self, status: int, took: float, what: str, code: str, failure: str | None) -> None:
        """Count one answer: its status, code and failure, and whether it was the slowest."""
        self.statuses[status] += 1
        if took > self.slowest[0]:
            self.slowest = (took, f"{status} {what}")
        if code:
            self.codes[f"{status} {code}"] += 1
        if failure:
            self.failures.append(failure)


def check(case: Case, status: int, body: bytes) -> tuple[str, str | None]:
    """(error code or "", failure or None) of one answer."""
    if status == 200:
        return "", None
    try:
        doc = json.loads(body)
        # Ours and OpenAI's: {"error": {...}}; an engine's own refusal passed through as vLLM
        # writes it: {"object": "error", "type": ..., "message": ...}.
        err = doc if doc.get("object") == "error" else doc["error"]
        code = str(err.get("code") if "error" in doc else err.get("type")) or ""
    except (ValueError, KeyError, TypeError, AttributeError):
        return "", f"{status} not JSON: {body[:120]!r} for {case.path} {case.raw[:120]!r}"
    if status >= 500 and code not in DEFINED_5XX:
        return code, f"{status} {code}: {body[:160]!r} for {case.raw[:160]!r}"
    auth_value = case.headers.get("Authorization", "")
    if len(auth_value) > 12 and auth_value[7:] and auth_value[7:].encode() in body:
        return code, f"{status}: the API key is echoed in the answer"
    return code, None
