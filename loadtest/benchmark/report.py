"""Benchmark report: per-request records in, tables, JSON and plots out. Pure except `plots`.

A record is one request as the client saw it. "Lost" means the client got no answer, a reset,
or a 5xx that the policy did not produce (the policy's own refusals are 429s and 503s with a
named `error.code`); lost requests are the one number that must be zero.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.benchmark.fair import fair_shares, shares, windowed_fair
from loadtest.benchmark.hits import after_answers, cached_share, prefix_hit_ratio
from loadtest.benchmark.records import Record, percentile

WARM_S = 5.0  # requests sent from this second on: the nodes' prefix caches and rates are warm


BUSY_S = 10.0  # the window in which a class's busiest arrivals are counted


def busiest(records: list[Record], window_s: float = BUSY_S) -> int:
    """The most of `records` sent within any `window_s` seconds. With conversations the
    arrivals are the system's: a turn goes once the last one's answer came, so a system that
    answers fast is sent the turns that waited on their answers sooner, in denser spells,
    and one that answers slowly is sent them spread out (docs/benchmarks.md)."""
    times = sorted(r.sent_s for r in records)
    most, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] >= window_s:
            lo += 1
        most = max(most, hi - lo + 1)
    return most


def attainment(records: list[Record], ttft_target_s: float) -> float:
    """Share of the class's requests (refused ones included) answered with TTFT within target."""
    if not records:
        return math.nan
    return sum(
        1 for r in records if r.ok and r.ttft_s is not None and r.ttft_s <= ttft_target_s
    ) / len(records)


@dataclass
class SystemResult:
    system: str
    seconds: float  # the makespan: first arrival to last answer
    records: list[Record]
    nodes: dict[str, dict[str, float]] = field(
        default_factory=dict
    )  # node → peak_memory, preemptions
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # name → (t, value)


def met(r: Record, slo_ttft_s: dict[str, float], slo_e2e_s: dict[str, float]) -> bool:
    """Answered within every target its class has (TTFT and end to end)."""
    if not r.ok:
        return False
    if r.cls in slo_ttft_s and (r.ttft_s or 0) > slo_ttft_s[r.cls]:
        return False
    return not (r.cls in slo_e2e_s and (r.e2e_s or 0) > slo_e2e_s[r.cls])


def summarise(
    res: SystemResult,
    slo_ttft_s: dict[str, float],
    tenant_weights: dict[str, float],
    slo_e2e_s: dict[str, float] | None = None,
    slo_tpot_s: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Per class: attainment of each target its class has, over every request sent (refused
    and lost ones miss); TPOT is (e2e − TTFT) ÷ (output tokens − 1), a one-token answer meets
    it. Goodput counts TTFT and e2e targets (as before TPOT was scored)."""
    slo_e2e_s = slo_e2e_s or {}
    slo_tpot_s = slo_tpot_s or {}
    by_cls: dict[str, list[Record]] = defaultdict(list)
    for r in res.records:
        by_cls[r.cls].append(r)
    followed = after_answers(res.records)
    classes = {}
    for cls, rs in sorted(by_cls.items()):
        ok = [r for r in rs if r.ok]
        classes[cls] = {
            "sent": len(rs),
            # Where turns wait for answers, the most sent in any BUSY_S: what the system met.
            "sent_busiest": busiest(rs) if any(r.conversation for r in rs) else None,
            "ok": len(ok),
            "slo_ttft_ms": slo_ttft_s[cls] * 1000 if cls in slo_ttft_s else None,
            "slo_attainment": attainment(rs, slo_ttft_s[cls]) if cls in slo_ttft_s else None,
            # The same over the requests sent from WARM_S on: a 60 s run's first seconds are
            # the cold start (empty prefix caches, prefill rates not yet measured) that a node
            # serving for days goes through once; the whole-run figure above is the headline.
            "slo_attainment_warm": (
                attainment([r for r in rs if r.sent_s >= WARM_S], slo_ttft_s[cls])
                if cls in slo_ttft_s
                else None
            ),
            "slo_e2e_ms": slo_e2e_s[cls] * 1000 if cls in slo_e2e_s else None,
            "e2e_attainment": (
                sum(1 for r in rs if r.ok and (r.e2e_s or 0) <= slo_e2e_s[cls]) / len(rs)
                if cls in slo_e2e_s and rs
                else None
            ),
            "slo_tpot_ms": slo_tpot_s[cls] * 1000 if cls in slo_tpot_s else None,
            "tpot_attainment": (
                sum(1 for r in rs if r.ok and (r.tpot_s or 0) <= slo_tpot_s[cls]) / len(rs)
                if cls in slo_tpot_s and rs
                else None
            ),
            "tpot_p50_ms": percentile([t * 1000 for r in ok if (t := r.tpot_s) is not None], 50),
            "ttft_p50_ms": percentile([r.ttft_s * 1000 for r in ok if r.ttft_s is not None], 50),
            "ttft_p99_ms": percentile([r.ttft_s * 1000 for r in ok if r.ttft_s is not None], 99),
            "e2e_p50_ms": percentile([r.e2e_s * 1000 for r in ok if r.e2e_s is not None], 50),
            "e2e_p99_ms": percentile([r.e2e_s * 1000 for r in ok if r.e2e_s is not None], 99),
            "refused": dict(
                Counter(
                    r.code or str(r.status) for r in rs if r.status not in (0, 200) and not r.lost
                )
            ),
            "lost": sum(1 for r in rs if r.lost),
            "prefix_hits": cached_share(ok),
            "prefix_hits_followed": (
                cached_share([r for r in ok if id(r) in followed])
                if any(r.conversation for r in rs)
                else None
            ),
        }
    served: dict[str, float] = defaultdict(float)
    demand: dict[str, float] = defaultdict(float)  # output tokens asked for, answered or not
    unserved: Counter[str] = Counter()  # realtime requests not answered, per tenant
    for r in res.records:
        if r.cls == "realtime":
            if r.ok:
                served[r.tenant] += r.completion_tokens
                demand[r.tenant] += r.completion_tokens
            else:
                unserved[r.tenant] += 1
                demand[r.tenant] += r.asked_tokens
    fair = fair_shares(sum(served.get(t, 0.0) for t in tenant_weights), demand, tenant_weights)
    fair_w = windowed_fair(res.records, tenant_weights)
    good = sum(r.completion_tokens for r in res.records if met(r, slo_ttft_s, slo_e2e_s))
    return {
        "system": res.system,
        "seconds": res.seconds,
        # Goodput: output tokens of requests answered within every target of their class (TTFT,
        # end to end; classes without targets count when answered), over the real makespan;
        # throughput counts every answered request.
        "goodput_tokens_per_s": good / res.seconds,
        # The same tokens as a count: a system that refuses work ends sooner, so its rate can be
        # higher while it serves fewer requests well; the count shows it.
        "good_tokens": good,
        "throughput_tokens_per_s": sum(r.completion_tokens for r in res.records if r.ok)
        / res.seconds,
        "completed_per_s": sum(1 for r in res.records if r.ok) / res.seconds,
        "lost": sum(1 for r in res.records if r.lost),
        "generator_late_p99_ms": percentile([r.late_s * 1000 for r in res.records], 99),
        "classes": classes,
        # A tenant that got every realtime request answered was not backlogged: it took what it
        # asked for, and its share says nothing about fairness (only backlogged tenants' do).
        # `fair`: its weighted max-min fair share of what was served, given what each asked for
        # (a tenant asking less than its weight's share is owed only that): the share to meet.
        # `fair_windowed`: the same, window by window (what a scheduler could have done).
        "realtime_shares": {
            t: {
                "served": s,
                "weight": w,
                "fair": fair[t],
                "fair_windowed": fair_w[t],
                "backlogged": unserved[t] > 0,
            }
            for t, (s, w) in shares(served, tenant_weights).items()
        },
        "nodes": res.nodes,
        "prefix_hit_ratio": prefix_hit_ratio(res.nodes),
    }


def _f(x: Any, fmt: str = "{:.0f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return fmt.format(x)


def markdown(summaries: list[dict[str, Any]]) -> str:
    lines = [
        "| system | class | sent | SLO (TTFT) attainment | e2e / TPOT SLO | TTFT p50 / p99 ms | e2e p50 / p99 ms | refused | lost | prompt cached |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for s in summaries:
        for cls, c in s["classes"].items():
            warm = c.get("slo_attainment_warm")
            att = _f(c["slo_attainment"], "{:.1%}") + (
                f" (≤{c['slo_ttft_ms']:.0f} ms; {_f(warm, '{:.1%}')} from {WARM_S:.0f} s)"
                if c["slo_ttft_ms"]
                else ""
            )
            ref = ", ".join(f"{k} {v}" for k, v in sorted(c["refused"].items())) or "–"
            e2e = _f(c.get("e2e_attainment"), "{:.1%}")
            hits = c.get("prefix_hits_followed")
            followed = f" ({hits:.1%} after an answered turn)" if hits is not None else ""
            if c.get("tpot_attainment") is not None:
                e2e += f" / {c['tpot_attainment']:.1%}"
            busy = c.get("sent_busiest")
            sent = f"{c['sent']} ({busy} in {BUSY_S:.0f} s)" if busy is not None else c["sent"]
            lines.append(
                f"| {s['system']} | {cls} | {sent} | {att} | {e2e} | {_f(c['ttft_p50_ms'])} / {_f(c['ttft_p99_ms'])} "
                f"| {_f(c['e2e_p50_ms'])} / {_f(c['e2e_p99_ms'])} | {ref} | {c['lost']} "
                f"| {_f(c.get('prefix_hits'), '{:.1%}')}{followed} |"
            )
    lines += [
        "",
        "| system | goodput tok/s | good tokens | makespan s | throughput tok/s | completed/s | lost | realtime token shares (served vs weighted max-min fair over the run / per 10 s; weight), backlogged tenants | peak effective memory | preemptions | prefix hits |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for s in summaries:
        rs = s["realtime_shares"]
        if rs and not any(v.get("backlogged", True) for v in rs.values()):
            sh = "no tenant backlogged: every realtime request answered"
        else:
            sh = ", ".join(
                f"{t} {_f(v['served'], '{:.0%}')} vs {_f(v.get('fair'), '{:.0%}')}"
                f" / {_f(v.get('fair_windowed'), '{:.0%}')} ({v['weight']:.0%})"
                if v.get("backlogged", True)
                else f"{t} all answered"
                for t, v in rs.items()
            )
        mem = max((n.get("peak_memory", math.nan) for n in s["nodes"].values()), default=math.nan)
        pre = sum(n.get("preemptions", 0) for n in s["nodes"].values())
        lines.append(
            f"| {s['system']} | {s['goodput_tokens_per_s']:.0f} | {s['good_tokens']:,} | {s['seconds']:.1f} | {s['throughput_tokens_per_s']:.0f} | {s['completed_per_s']:.1f} | {s['lost']} | {sh} "
            f"| {_f(mem, '{:.1%}')} | {pre:.0f} | {_f(s.get('prefix_hit_ratio'), '{:.1%}')} |"
        )
    return "\n".join(lines)


def write_json(path: Path, summaries: list[dict[str, Any]], results: list[SystemResult]) -> None:
    doc = {
        "summaries": summaries,
        "records": {r.system: [asdict(x) for x in r.records] for r in results},
    }
    path.write_text(
        json.dumps(
            doc, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x
        )
    )


def plots(
    out_dir: Path, results: list[SystemResult], summaries: list[dict[str, Any]]
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    classes = sorted({r.cls for res in results for r in res.records})
    fig, axes = plt.subplots(1, len(classes), figsize=(5 * len(classes), 4), squeeze=False)
    for ax, cls in zip(axes[0], classes, strict=True):
        for res in results:
            xs = sorted(
                r.ttft_s for r in res.records if r.cls == cls and r.ok and r.ttft_s is not None
            )
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=res.system)
        ax.set_xscale("log")
        ax.set_title(f"TTFT CDF — {cls}")
        ax.set_xlabel("seconds")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    tenants = list(summaries[0]["realtime_shares"]) if summaries else []
    width = 0.8 / (len(summaries) + 1)
    for i, s in enumerate(summaries):
        xs = [j + i * width for j in range(len(tenants))]
        rs = s["realtime_shares"]
        ax.bar(xs, [rs[t]["served"] for t in tenants], width, label=s["system"])
        # This system's weighted max-min fair share (it depends on what it served): a tick.
        ax.scatter(
            xs,
            [rs[t].get("fair", math.nan) for t in tenants],
            marker="_",
            s=400,
            color="black",
            label="fair share (weighted max-min)" if i == 0 else None,
        )
    if summaries:
        ax.bar(
            [j + len(summaries) * width for j in range(len(tenants))],
            [summaries[0]["realtime_shares"][t]["weight"] for t in tenants],
            width,
            label="weight",
            color="grey",
        )
    ax.set_xticks([j + 0.4 for j in range(len(tenants))], tenants)
    ax.set_title("realtime: share of served tokens vs fair share and weight")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "shares.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for res in results:
        for name, pts in res.series.items():
            ax = axes[0] if name == "queued" else axes[1]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{res.system} {name}")
    axes[0].set_title("queue depth (admission: sidecar queue; others: vLLM waiting)")
    axes[1].set_title("effective node memory (fraction)")
    axes[1].set_xlabel("seconds")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(out_dir / "timeline.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths
