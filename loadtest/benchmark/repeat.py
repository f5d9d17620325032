"""`bench --repeat N`: the same comparison N times, each round on its own seeded arrivals (seed,
seed + 1, …; every system of a round gets the same ones) and with the systems' order rotated
round by round, so that a machine drifting in speed weighs on all of them alike. One run of the
mixed bench spreads by ±9 points of attainment on this kind of machine (docs/benchmarks.md):
a claim needs the median and the spread of several, and the paired differences.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

OURS = "admission"


def order(systems: list[str], rnd: int) -> list[str]:
    """Round `rnd`'s order: the list rotated by `rnd`."""
    k = rnd % len(systems)
    return systems[k:] + systems[:k]


def _spread(xs: list[float], fmt: str) -> str:
    if not xs:
        return "–"
    med = statistics.median(xs)
    if len(xs) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def _figures(s: dict[str, Any]) -> dict[str, float]:
    """The figures compared across rounds: goodput, good tokens, prefix hits, and per class
    the TTFT attainment."""
    out = {"goodput": s["goodput_tokens_per_s"], "good_tokens": float(s["good_tokens"])}
    if s.get("prefix_hit_ratio") is not None:
        out["prefix_hits"] = s["prefix_hit_ratio"]
    for cls, c in s["classes"].items():
        if c.get("slo_attainment") is not None:
            out[f"ttft:{cls}"] = c["slo_attainment"]
    return out


def table(rounds: list[list[dict[str, Any]]]) -> str:
    """Markdown: per system the median (min–max) of each figure over the rounds, then the
    product's paired differences against each other system (ours − theirs, round by round)."""
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    systems: list[str] = []
    for summaries in rounds:
        for s in summaries:
            if s["system"] not in systems:
                systems.append(s["system"])
            for k, v in _figures(s).items():
                per[s["system"]][k].append(v)
    classes = sorted({k for figs in per.values() for k in figs if k.startswith("ttft:")})
    head = ["system", "rounds", "goodput tok/s", "good tokens"]
    head += [f"{c[5:]} TTFT att." for c in classes]
    head.append("prefix hits")
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name in systems:
        f = per[name]
        cells = [name, str(len(f["goodput"])), _spread(f["goodput"], "{:.0f}")]
        cells.append(_spread(f["good_tokens"], "{:,.0f}"))
        cells += [_spread(f.get(c, []), "{:.1%}") for c in classes]
        cells.append(_spread(f.get("prefix_hits", []), "{:.1%}"))
        lines.append("| " + " | ".join(cells) + " |")
    if OURS not in per or len(systems) < 2:
        return "\n".join(lines)
    lines += [
        "",
        f"Paired, {OURS} − each other system, round by round: median (min–max), rounds won.",
    ]
    lines += [
        "",
        "| against | goodput tok/s | "
        + " | ".join(f"{c[5:]} TTFT att. (points)" for c in classes)
        + " |",
    ]
    lines.append("|---" * (2 + len(classes)) + "|")
    ours = per[OURS]
    for name in systems:
        if name == OURS:
            continue
        cells = [name]
        for key, scale, fmt in [("goodput", 1.0, "{:+.0f}")] + [
            (c, 100.0, "{:+.1f}") for c in classes
        ]:
            a, b = ours.get(key, []), per[name].get(key, [])
            d = [(x - y) * scale for x, y in zip(a, b, strict=False)]
            won = sum(1 for x in d if x > 0)
            cells.append(f"{_spread(d, fmt)}, {won}/{len(d)}" if d else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
