"""The live status page of a sidecar (`GET /status`, and its data `GET /status.json`).

Read-only, on the admin port (loopback by default). What an SRE looks at first: queue depth per
class and tenant and how long requests waited, node states with measured and projected memory,
memory-aware limits in force, what keeps each class waiting (the node rules that said no, in
the policy's terms), the last 500 refusals grouped by tenant, class and reason, and the policy
version in force. The page is one static HTML file (package data) that polls `/status.json`
every second.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections import Counter, deque
from dataclasses import dataclass
from importlib import resources
from typing import Any

from admission.policy import Policy
from admission.scheduling.answer_lengths import decode_limit_s, own_decode_limit_s
from admission.scheduling.overload import State
from admission.scheduling.routing import urgent_present

WINDOW_S = 60.0  # wait percentiles over this much recent history


@dataclass(frozen=True)
class Refusal:
    at: float
    tenant: str
    cls: str
    outcome: str
    reason: str
    request_id: str = ""


class Recent:
    """Bounded recent history the page shows: refusals and queue waits."""

    def __init__(self, refusals: int = 500, waits: int = 4096) -> None:
        self.refusals: deque[Refusal] = deque(maxlen=refusals)
        self.waits: deque[tuple[float, str, float]] = deque(maxlen=waits)

    def decided(
        self, tenant: str, cls: str, outcome: str, reason: str, waited_s: float, rid: str = ""
    ) -> None:
        now = time.time()
        if outcome == "admitted":
            self.waits.append((now, cls, waited_s))
        elif outcome != "cancelled":
            self.refusals.append(Refusal(now, tenant, cls, outcome, reason, rid))

    def late_refused(self, now: float) -> Counter[str]:
        """Per class, how many were refused `slo_unreachable` (on_late: refuse) in the window:
        overload past what any order serves, answered early with Retry-After. Among the refusals
        kept (the last 500): under a flood the window holds fewer than 60 s of them."""
        return Counter(
            r.cls for r in self.refusals if r.reason == "slo_unreachable" and now - r.at <= WINDOW_S
        )

    def wait_percentiles(self, now: float) -> dict[str, dict[str, float]]:
        by_cls: dict[str, list[float]] = {}
        for at, cls, w in self.waits:
            if now - at <= WINDOW_S:
                by_cls.setdefault(cls, []).append(w)
        out = {}
        for cls, ws in by_cls.items():
            ws.sort()
            out[cls] = {
                "admitted": len(ws),
                "p50_ms": round(ws[len(ws) // 2] * 1000, 1),
                "p95_ms": round(ws[min(len(ws) - 1, int(len(ws) * 0.95))] * 1000, 1),
            }
        return out


def snapshot(
    dispatcher: Any, recent: Recent, version: str, loaded_at: float, degraded: bool
) -> dict[str, Any]:
    """Everything the page shows, as JSON."""
    now = time.time()
    mono = dispatcher.clock()
    depth: Counter[tuple[str, str]] = Counter()
    oldest: dict[str, float] = {}
    for item in dispatcher.queue.items():
        depth[(item.cls, item.tenant)] += 1
        oldest[item.cls] = max(oldest.get(item.cls, 0.0), mono - item.enqueued_at)
    policy = dispatcher.policy()
    classes = list(policy.classes)
    late = recent.late_refused(now)
    return {
        "now": now,
        # Which sidecar this is: the page of one of several behind one NGINX says so.
        "sidecar": {"host": socket.gethostname(), "pid": os.getpid()},
        "policy": {"version": version, "loaded_at": loaded_at},
        "redis": "degraded (local limits)" if degraded else "ok",
        "queue": {
            "total": len(dispatcher.queue),
            "classes": [
                {
                    "class": c,
                    "depth": dispatcher.queue.depth(c),
                    "oldest_wait_s": round(oldest.get(c, 0.0), 2),
                    "on_late": policy.classes[c].on_late.value,
                    "late_refused_60s": late[c],
                }
                for c in classes
            ],
            "tenants": [
                {"class": c, "tenant": t, "depth": n} for (c, t), n in sorted(depth.items())
            ],
        },
        "waits": recent.wait_percentiles(now),
        "nodes": dispatcher.nodes.snapshot(),
        "pressure": dispatcher.nodes.pressure.snapshot(),
        "decode_guard": _decode_guard(dispatcher),
        # KV a request books for its answer, where its tenant's answers are known
        # (answer_lengths.py); elsewhere its max_tokens.
        "answers_booked": dispatcher.nodes.answers.booked_answers(),
        "fair_shed": dispatcher.place.shed.snapshot(mono),
        # Per (model, class) past capacity now: short, late or shedding (overload.py).
        "overload": dispatcher.overload.snapshot(mono),
        "prefix": dispatcher.nodes.placements.snapshot(),
        "refusals": _grouped(recent.refusals),
        "held": _held(dispatcher, policy, mono),
        # Per model: nodes serving and nodes the demand needs (scheduling/demand.py).
        "demand": dispatcher.demand.now(),
    }


def _decode_guard(dispatcher: Any) -> dict[str, Any]:
    """The urgent class's mean answer length as learned, the decode speed it asks of a node
    before lower classes may go there (answer_lengths.py; null: no tpot target), whether the
    guard acts now (the urgent class has KV booked on some node, as of this sidecar's last
    read of the ledger, or waits here), past what speed the urgent class itself waits
    (`own_limit_ms`; null: it does not — it serves late, or its answers are not learned yet),
    whether that acts now (`own_active`: this sidecar refused it late lately), and the classes
    it lets through now for some model, admitted less than their min_share while the urgent
    class is refused late (`under_min_share`; Dispatcher.owed)."""
    policy = dispatcher.policy()
    mean = dispatcher.nodes.answers.mean
    limit = decode_limit_s(policy, mean)
    cls = next((c for c in policy.classes if policy.is_urgent(c)), None)
    own = own_decode_limit_s(policy, cls, mean) if cls else None
    now, over = dispatcher.clock(), dispatcher.overload
    late = (State.LATE.value, State.SHEDDING.value)
    refusing = any(s["class"] == cls and s["state"] in late for s in over.snapshot(now))
    waiting = dispatcher.nodes.urgent_waiting(dispatcher.queue.waiting_kv)
    active = limit is not None and urgent_present(
        list(dispatcher.nodes.views.values()), None, waiting
    )
    return {
        "urgent_output_tokens": round(mean, 1),
        "limit_ms": None if limit is None else round(limit * 1000, 1),
        "active": active,
        "own_limit_ms": None if own is None else round(own * 1000, 1),
        "own_active": own is not None and refusing,
        "under_min_share": sorted(
            c
            for c in policy.classes
            if any(dispatcher.owed(m, c) for m in dispatcher.place.shed.models())
        ),
    }


def _held(dispatcher: Any, policy: Policy, mono: float) -> dict[str, Any]:
    """What kept each class waiting over about the last minute: the node checks that said no to
    its queued requests that then found no node (`admission_held_checks_total`), by rule, most
    first, and what the first of them means in the policy's words (`waits_for`). Checks, not
    requests: a waiting request is checked again at every pass."""
    span, counts = dispatcher.metrics.held_recent.since(mono)
    by_cls: dict[str, Counter[str]] = {}
    for (cls, reason), n in counts.items():
        by_cls.setdefault(cls, Counter())[reason] += n
    out = []
    order = [c for c in policy.classes if c in by_cls] + sorted(set(by_cls) - set(policy.classes))
    for cls in order:
        tally = by_cls[cls]
        total = sum(tally.values())
        ranked = tally.most_common()
        out.append(
            {
                "class": cls,
                "checks": total,
                "reasons": [
                    {"reason": r, "checks": n, "share": round(n / total, 3)} for r, n in ranked
                ],
                "why": waits_for(policy, cls, ranked[0][0]),
            }
        )
    return {"span_s": round(span, 1), "classes": out}


def waits_for(policy: Policy, cls: str, reason: str) -> str:
    """One node rule (gates.GATE_REASONS) in plain words, with the policy setting behind it."""
    wm = policy.watermarks
    top = next((c for c in policy.classes if policy.is_urgent(c)), None)
    own = policy.is_urgent(cls)  # admitted until drain: held nodes take it
    mark = f"watermarks.drain ({wm.drain:.2f})" if own else f"watermarks.hold ({wm.hold:.2f})"
    slo = policy.classes[top] if top else None
    if reason == "state" and own:
        return "nodes down or in maintenance (`admission node list`)"
    if reason == "state":
        return (
            f"nodes held or drained by memory ({mark}; open again below watermarks.reopen "
            f"({wm.reopen:.2f})), down, or in maintenance (`admission node list`)"
        )
    if reason == "inflight":
        return "nodes at their in-flight cap (nodes.<id>.max_inflight)"
    if reason == "measured":
        return f"measured GPU memory at or above {mark}"
    if reason == "booked":
        return (
            f"KV booked on the nodes would pass {mark}: every running request counts its "
            "prompt and its whole max_tokens until its answer ends"
        )
    if reason == "decode" and own:
        return (
            "its own decode guard while it is refused late: nodes whose decode would finish its "
            f"answers late (classes.{top}.slo.tpot_ms / e2e_ms)"
        )
    if reason == "decode" and slo is not None:
        tpot = f"{slo.slo_tpot_ms:g} ms" if slo.slo_tpot_ms else "none"
        return (
            f"the decode guard: nodes' time per output token above what {top} may see "
            f"(classes.{top}.slo.tpot_ms: {tpot}, or what its e2e_ms asks); a looser target "
            f"lets this class onto busier nodes, at {top}'s decode speed"
        )
    if reason == "reserve" and top:
        return (
            f"room kept under watermarks.drain ({wm.drain:.2f}) on each node for {top}'s "
            "recent peak of KV (the urgent reserve)"
        )
    if reason == "prefill" and slo is not None and slo.slo_ttft_ms:
        budget = f"the prefill a node clears in classes.{top}.slo.ttft_ms ({slo.slo_ttft_ms:g} ms)"
        if own:
            return f"nodes' pending prefill past {budget}: a first token there would be late"
        return f"nodes' pending prefill past {budget}, and only idle prefill where {top} runs"
    return reason


def _grouped(refusals: deque[Refusal]) -> list[dict[str, Any]]:
    """The recent refusals by (tenant, class, reason): how many, and the last one's time and
    request id (the client's x-request-id); most recent first."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in refusals:
        g = groups.setdefault(
            (r.tenant, r.cls, r.reason),
            {
                "tenant": r.tenant,
                "class": r.cls,
                "reason": r.reason,
                "count": 0,
                "last_at": 0.0,
                "last_request_id": "",
            },
        )
        g["count"] += 1
        if r.at >= g["last_at"]:
            g["last_at"], g["last_request_id"] = r.at, r.request_id
    return sorted(groups.values(), key=lambda g: -g["last_at"])


@functools.cache
def page() -> str:
    return resources.files("admission").joinpath("status.html").read_text()
