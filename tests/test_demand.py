"""The demand signal (scheduling/demand.py) on hand-built node views: how busy the serving nodes
are, times how much more is asked than served, over the target utilisation."""

from __future__ import annotations

from admission.nodes.state import Status
from admission.policy import Node, load_policy
from admission.scheduling.demand import WINDOW_S, Demand, utilisation
from admission.scheduling.views import NodeView
from devstack.stack import DEFAULT_POLICY

POLICY = load_policy(DEFAULT_POLICY)
MODEL = next(iter(POLICY.models()))


def view(nid: str, inflight: int, state: Status = Status.OPEN) -> NodeView:
    v = NodeView(Node(nid, f"http://127.0.0.1:1/{nid}", (MODEL,), max_inflight=10), state)
    v.inflight = inflight
    v.memory = v.base_memory = 0.4  # weights only: memory does not bind here
    return v


def decide(d: Demand, n: int, outcome: str, reason: str, now: float = 100.0) -> None:
    for _ in range(n):
        d.decided(MODEL, outcome, reason, now)


def test_idle_needs_nothing_and_served_demand_needs_what_is_busy_over_the_target() -> None:
    d = Demand()
    views = [view("a", 5), view("b", 5)]
    assert d.estimate(POLICY, views, {}, 100.0)[MODEL]["needed"] == 0  # nothing asked
    decide(d, 50, "admitted", "ok")
    got = d.estimate(POLICY, views, {}, 100.0)[MODEL]
    # Two nodes half busy: one node's work, at 80 % per node: two nodes.
    assert (got["serving"], got["busy"], got["demand_factor"], got["needed"]) == (2, 1.0, 1.0, 2)


def test_refusals_for_capacity_and_waiting_requests_raise_the_need_others_do_not() -> None:
    d = Demand()
    views = [view("a", 10), view("b", 10), view("c", 10, Status.DRAIN)]  # drain: not serving
    decide(d, 100, "admitted", "ok")
    decide(d, 60, "throttled", "slo_unreachable")
    decide(d, 30, "throttled", "over_fair_share")
    decide(d, 500, "throttled", "requests_per_s")  # a tenant's own limit: not capacity
    got = d.estimate(POLICY, views, {MODEL: 10}, 100.0)[MODEL]
    # Busy 2 nodes; asked (100 + 90 + 10) / 100 = 2×: 2 × 2 / 0.8 = 5 nodes.
    assert (got["serving"], got["demand_factor"], got["needed"]) == (2, 2.0, 5)
    assert got["short_60s"] == 90 and got["waiting"] == 10


def test_no_node_serving_asks_for_one_and_the_window_forgets() -> None:
    d = Demand()
    decide(d, 5, "rejected", "no_capacity")
    assert d.estimate(POLICY, [], {}, 100.0)[MODEL]["needed"] == 1
    later = 100.0 + WINDOW_S + 1
    assert d.estimate(POLICY, [], {}, later)[MODEL]["needed"] == 0


def test_a_nodes_binding_resource_is_its_utilisation() -> None:
    v = view("a", 2)
    hold = POLICY.watermarks.hold
    assert utilisation(v, hold, 1.0, 0.0) == 0.2  # slots
    v.memory = v.base_memory + 0.75 * (hold - v.base_memory)  # KV three quarters of its room
    assert abs(utilisation(v, hold, 1.0, 0.0) - 0.75) < 1e-9
    v.prefill_rate, v.pending, v.pending_at = 1000.0, 1500.0, 0.0  # 1.5 s of prefill, 1 s target
    assert abs(utilisation(v, hold, 1.0, 0.0) - 1.5) < 1e-9
