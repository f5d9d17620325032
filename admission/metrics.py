"""Prometheus metrics of the sidecar, in one registry per process.

Labels never carry API keys (tenants are named by id only), and every label set is bounded by
the policy (tenants, classes, nodes, reasons).
"""

from __future__ import annotations

from collections import Counter as Tally
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class _Tally(Collector):
    """A counter family read from a plain tally at scrape time: the dispatcher counts node
    checks too often for a labelled Counter's lock."""

    def __init__(self, name: str, doc: str, labels: list[str], tally: Tally[Any]) -> None:
        self.name, self.doc, self.labels, self.tally = name, doc, labels, tally

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for labels, n in list(self.tally.items()):
            fam.add_metric(list(labels), n)
        yield fam


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._decided: dict[tuple[str, str, str, str], tuple[Any, Any]] = {}
        r = self.registry
        self.gate: Tally[tuple[str, str, str]] = Tally()  # (node, class, reason) → checks
        r.register(
            _Tally(
                "admission_node_gate",
                "Node checks that said no to a request, by node, class and the rule that said "
                "no (state, inflight, measured, booked, decode, reserve, prefill): why work waits.",
                ["node", "cls", "reason"],
                self.gate,
            )
        )
        # (class, reason) → node checks that said no to a request that then found no node at all
        self.held: Tally[tuple[str, str]] = Tally()
        r.register(
            _Tally(
                "admission_held_checks",
                "Node checks that said no to a queued request that found no node, by class and "
                "rule: what keeps each class waiting (the status page's 'Why requests wait').",
                ["cls", "reason"],
                self.held,
            )
        )
        self.held_recent = Rolling(self.held)  # the status page's last minute (running.py ticks)
        # One routing decision's no's, (node, class, reason): filled by routing, then counted
        # and cleared by said_no (one scratch tally: no allocation per decision).
        self.noes: Tally[tuple[str, str, str]] = Tally()
        self.decisions = Counter(
            "admission_decisions_total",
            "Admission outcomes by tenant, class, outcome (admitted/throttled/rejected/timeout/"
            "cancelled/error) and reason.",
            ["tenant", "cls", "outcome", "reason"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "admission_decision_seconds",
            "Time from /admit arrival to its answer, queue wait included.",
            ["cls"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "admission_queue_wait_seconds",
            "Time admitted requests spent in the queue.",
            ["cls"],
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.prefix_predicted = Counter(
            "admission_prefix_predicted_tokens",
            "Prompt tokens booked as already computed on their node (the prefix index's guess), "
            "counted for releases whose engine reported its cached tokens.",
            registry=r,
        )
        self.prefix_engine_cached = Counter(
            "admission_prefix_engine_cached_tokens",
            "Prompt tokens the engines reported as found in their prefix cache "
            "(usage.prompt_tokens_details.cached_tokens), for the same releases: the truth "
            "beside admission_prefix_predicted_tokens_total.",
            registry=r,
        )
        self.queue_depth = Gauge(
            "admission_queue_depth",
            "Requests waiting in this sidecar's queue.",
            ["cls"],
            registry=r,
        )
        self.shadow_decisions = Counter(
            "admission_shadow_decisions_total",
            "Decisions of tenants in shadow mode: what their limits would have done.",
            ["tenant", "would"],
            registry=r,
        )
        self.node_ejections = Counter(
            "admission_node_ejections_total",
            "Times a node was taken out of rotation because proxied requests could not reach it.",
            ["node"],
            registry=r,
        )
        self.fair_shed = Counter(
            "admission_fair_shed_total",
            "Requests refused at arrival (over_fair_share): their class past capacity, their "
            "tenant over its weight's share.",
            ["cls"],
            registry=r,
        )
        self.late_refused = Counter(
            "admission_late_refused_total",
            "Queued requests refused because their class's TTFT target could no longer be met.",
            ["cls"],
            registry=r,
        )
        self.ahead = Counter(
            "admission_ahead_total",
            "Admissions answered before Redis booked them, by how the booking went: confirmed;"
            " over_limits / over_node: booked past a tenant or node limit another sidecar reached"
            " first; unconfirmed: Redis failed, the lease was given back.",
            ["result"],
            registry=r,
        )
        # Children resolved once (exported at 0 from the start): no label lookup per booking.
        self.ahead_by = {
            result: self.ahead.labels(result)
            for result in ("confirmed", "over_limits", "over_node", "unconfirmed")
        }
        self.redis_errors = Counter(
            "admission_redis_errors_total",
            "Redis calls that failed, by operation.",
            ["op"],
            registry=r,
        )
        self.overloaded = Counter(
            "admission_sidecar_overloaded_total",
            "Redis calls this sidecar's late event loop timed out, by operation: refused "
            "(sidecar_overloaded) or the last view kept; never the failure mode.",
            ["op"],
            registry=r,
        )
        self.redis_fallback = Gauge(
            "admission_redis_fallback",
            "1 while Redis is unreachable and the failure mode is in force.",
            registry=r,
        )
        self.redis_backlog = Gauge(
            "admission_redis_backlog",
            "Releases and compensations waiting for Redis to answer again.",
            registry=r,
        )
        self.redis_backlog_dropped = Counter(
            "admission_redis_backlog_dropped_total",
            "Backlog entries dropped because the backlog was full (their TTLs free them).",
            registry=r,
        )
        self.policy_reloads = Counter(
            "admission_policy_reloads_total",
            "Policy reloads by result (ok/invalid).",
            ["result"],
            registry=r,
        )
        self.limit_factor = Gauge(
            "admission_limit_factor",
            "Factor on the refill rates of classes below the most urgent one, per model: < 1 "
            "while every node of the model has been held for watermarks.tighten_after_s.",
            ["model"],
            registry=r,
        )
        self.model_nodes_needed = Gauge(
            "admission_model_nodes_needed",
            "Nodes the current demand needs per model to meet its classes' targets (the "
            "demand signal; scheduling/demand.py): scale out above admission_model_nodes_serving.",
            ["model"],
            registry=r,
        )
        self.model_nodes = Gauge(
            "admission_model_nodes_serving",
            "Nodes open or held per model, as this sidecar last saw them (0: no_capacity).",
            ["model"],
            registry=r,
        )
        self.policy_rejected = Gauge(
            "admission_policy_file_rejected",
            "1 while policies.yaml on disk fails validation (the running policy is the last good"
            " one); 0 once a valid file is read again.",
            registry=r,
        )
        self.policy_loaded = Gauge(
            "admission_policy_loaded_timestamp_seconds",
            "When the running policy was loaded.",
            registry=r,
        )
        self.settled_tokens = Counter(
            "admission_settled_tokens_total",
            "Tokens refunded (direction=refund) or charged as overage (direction=overage).",
            ["tenant", "direction"],
            registry=r,
        )
        self.node_state = Gauge(
            "admission_node_state",
            "1 for the node's current state (open/hold/drain/down/maintenance).",
            ["node", "state"],
            registry=r,
        )
        self.node_memory = Gauge(
            "admission_node_memory_fraction",
            "Projected effective memory fraction of the node as the dispatcher sees it.",
            ["node"],
            registry=r,
        )
        self.node_prefix_hits = Gauge(
            "admission_node_prefix_cache_hit_ratio",
            "Share of prompt tokens the node's engine found in its prefix cache lately (the "
            "ledger books whole prompts: high here means booked KV well above KV in use).",
            ["node"],
            registry=r,
        )
        self.node_inflight = Gauge(
            "admission_node_inflight",
            "Requests this sidecar admitted to the node and not released.",
            ["node"],
            registry=r,
        )
        self.views_age = Gauge(
            "admission_node_views_age_seconds",
            "Seconds since this sidecar's node views were last read from Redis (a refresh that "
            "ended well; every 0.1 s while busy): its decisions and drains are this far behind.",
            registry=r,
        )
        self.redis_round_trip = Histogram(
            "admission_redis_round_trip_seconds",
            "One round trip of the admission scripts to Redis (a pipeline shared by every call "
            "that waited meanwhile), as the sidecar sees it: Redis, the network and this "
            "process's event loop. Most of an admission's own latency at low load.",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25),
            registry=r,
        )
        self.prompt_ratio = Histogram(
            "admission_prompt_tokens_ratio",
            "The engine's prompt tokens over the edge's estimate of them (edge.chars_per_token), "
            "per release with usage: far from 1, the ledger books prompts, prefill and KV in the "
            "wrong size.",
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0),
            registry=r,
        )
        self.dispatch_seconds = Histogram(
            "admission_dispatch_seconds",
            "CPU time of one dispatcher pass.",
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2),
            registry=r,
        )

    def decided(self, tenant: str, cls: str, outcome: str, reason: str, seconds: float) -> None:
        """Count one /admit answer and its latency. The labelled children are looked up once
        per label set (bounded by the policy), not per request."""
        key = (tenant, cls, outcome, reason)
        pair = self._decided.get(key)
        if pair is None:
            pair = self._decided[key] = (
                self.decisions.labels(*key),
                self.decision_seconds.labels(cls),
            )
        pair[0].inc()
        pair[1].observe(seconds)

    def said_no(self, waits: str | None) -> None:
        """Count the node checks that said no to one request (`noes`), (node, class, reason)
        each; when no node took it (`waits`: its class), also by (class, reason): what keeps its
        class waiting. No check at all: every node was skipped as full (candidates.py)."""
        noes = self.noes
        self.gate.update(noes)
        if waits is not None:
            if not noes:
                self.held[(waits, "inflight")] += 1
            for (_node, cls, reason), n in noes.items():
                self.held[(cls, reason)] += n
        noes.clear()


class Rolling:
    """Copies of a tally, at most one every `every_s`, kept `keep_s`: what it counted over about
    the last `keep_s` (`since`; over less until it has run that long), with no work added where
    it counts. `tick` from a loop that runs at least every `every_s`."""

    def __init__(self, tally: Tally[Any], keep_s: float = 60.0, every_s: float = 1.0) -> None:
        self.tally, self.keep_s, self.every_s = tally, keep_s, every_s
        self.copies: deque[tuple[float, Tally[Any]]] = deque()

    def tick(self, now: float) -> None:
        if not self.copies:
            self.copies.append((now, Tally()))  # counted before the first tick: counted since
        elif now - self.copies[-1][0] >= self.every_s:
            self.copies.append((now, Tally(self.tally)))
            while len(self.copies) > 1 and self.copies[1][0] <= now - self.keep_s:
                self.copies.popleft()

    def since(self, now: float) -> tuple[float, Tally[Any]]:
        """(seconds covered, what the tally counted in them)."""
        at, base = self.copies[0] if self.copies else (now, Tally())
        return now - at, Tally(self.tally) - base
