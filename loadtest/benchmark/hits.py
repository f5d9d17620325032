"""The prefix-cache figures of a benchmark run: the cluster's hit ratio from the engines' own
counters, and per class what the answered prompts found cached (their usage)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadtest.benchmark.records import Record


def cached_share(records: list[Record]) -> float | None:
    """Prompt tokens the engines' prefix caches held for these answered requests, over their
    prompt tokens (each answer's usage.prompt_tokens_details.cached_tokens), None when no engine
    reported them. Per class: the cluster's ratio also moves with which requests a system
    refuses, this one with where it sent those it served."""
    told = [r for r in records if r.cached_tokens >= 0 and r.prompt_tokens > 0]
    prompt = sum(r.prompt_tokens for r in told)
    return sum(r.cached_tokens for r in told) / prompt if prompt else None


def after_answers(records: list[Record]) -> set[int]:
    """ids of the records whose conversation's previous turn was answered, or that open one.
    A refused turn was never computed: the driver leaves it out of the history the next turn
    resends (workload.Histories; before, the next turn resent it and found only the turn before
    it cached). Over these, prompt cached says where a system sent the turns, not what it
    refused."""
    last: dict[str, Record] = {}
    out = set()
    for r in sorted((r for r in records if r.conversation), key=lambda r: r.sent_s):
        prev = last.get(r.conversation)
        if prev is None or prev.ok:
            out.add(id(r))
        last[r.conversation] = r
    return out


def prefix_hit_ratio(nodes: dict[str, dict[str, float]]) -> float | None:
    """The cluster's prefix-cache hit ratio from the engines' own counters (hit tokens over
    queried tokens, vllm:prefix_cache_hits / _queries), None when no engine reported them."""
    queries = sum(n.get("prefix_queries", 0.0) for n in nodes.values())
    return sum(n.get("prefix_hits", 0.0) for n in nodes.values()) / queries if queries else None
