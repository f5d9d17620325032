"""Where a request may go, as the dispatcher and routing decide it on real node views: fallbacks,
lower classes beside the urgent one (its KV, reserve and decode guard), and every node that
says no counted with its reason."""

from __future__ import annotations

from collections import Counter

import pytest

from admission.metrics import Metrics
from admission.nodes.state import Status
from admission.policy import Policy
from admission.scheduling.ask import Request
from admission.scheduling.gates import ask_for
from admission.scheduling.routing import ClusterFacts, eligible, fallbacks
from admission.scheduling.views import NodeView
from devstack.procs import RedisServer
from tests.conftest import BASE_POLICY, make_policy


def test_fallbacks_include_live_nodes_that_are_not_eligible(redis_server: RedisServer) -> None:
    # n1 is the only eligible node; n2 is held (not eligible for new batch work) and n3 drained.
    # If n1 refuses the connection, n2 can still serve: it is a fallback, n3 is not.
    text = BASE_POLICY.replace(
        'nodes:\n  n1: {url: "http://127.0.0.1:1", models: [m], memory_source: kv, max_inflight: 4}',
        "nodes:\n"
        + "".join(
            f'  n{i}: {{url: "http://127.0.0.1:{i}", models: [m], memory_source: kv}}\n'
            for i in (1, 2, 3)
        ),
    )
    p = make_policy(redis_server.url, text)
    views = {n: NodeView(p.nodes[n]) for n in p.nodes}
    for n, s in (("n1", Status.OPEN), ("n2", Status.HOLD), ("n3", Status.DRAIN)):
        views[n].state = s
    chosen = [
        v
        for v, _ask in eligible(
            list(views.values()), p, Request("m", "batch", 10, 20), ClusterFacts(0.0)
        )
    ]
    assert [v.node.id for v in chosen] == ["n1"]
    assert fallbacks(chosen, list(views.values()), "m") == [("n2", "http://127.0.0.1:2")]


def test_lower_classes_go_first_where_the_urgent_class_has_no_kv(
    redis_server: RedisServer,
) -> None:
    # n1 has realtime KV booked and nothing pending; n2 has no realtime and some batch prefill
    # pending. Batch goes to n2 first (the whole budget there, no realtime decode slowed);
    # realtime goes where its prefill starts soonest: n1.
    text = BASE_POLICY.replace("deadline_s: 5}", "deadline_s: 5, admit_until: drain}").replace(
        'nodes:\n  n1: {url: "http://127.0.0.1:1", models: [m], memory_source: kv, max_inflight: 4}',
        "nodes:\n"
        + "".join(
            f'  n{i}: {{url: "http://127.0.0.1:{i}", models: [m], memory_source: kv}}\n'
            for i in (1, 2)
        ),
    )
    p = make_policy(redis_server.url, text)
    views = [
        NodeView(p.nodes[n], state=Status.OPEN, per_token=0.0001, prefill_rate=1000.0)
        for n in ("n1", "n2")
    ]
    views[0].ledger(0.0, 50, 1, 0.0, urgent=50, reserve=50.0)
    views[1].ledger(300.0, 300, 1, 0.0, urgent=0, reserve=0.0)

    def order(cls: str) -> list[str]:
        return [
            v.node.id
            for v, _ask in eligible(views, p, Request("m", cls, 10, 20), ClusterFacts(0.0))
        ]

    assert order("batch") == ["n2", "n1"]
    assert order("realtime") == ["n1", "n2"]
    views[0].ledger(0.0, 0, 0, 0.0, urgent=0, reserve=0.0)  # realtime gone from n1
    assert order("batch") == ["n1", "n2"]  # then the soonest prefill decides again


def test_decode_guard_follows_what_the_urgent_class_answers_need(
    redis_server: RedisServer,
) -> None:
    from admission.scheduling.answer_lengths import MAX_OPEN, AnswerLengths, decode_limit_s

    slo = "slo: {ttft_ms: 1000, e2e_ms: 10000, tpot_ms: 60}"
    text = BASE_POLICY.replace("deadline_s: 5}", f"deadline_s: 5, admit_until: drain, {slo}}}")
    text = text.replace(
        'nodes:\n  n1: {url: "http://127.0.0.1:1", models: [m], memory_source: kv, max_inflight: 4}',
        'nodes:\n  n1: {url: "http://127.0.0.1:1", models: [m], memory_source: kv}\n'
        '  n2: {url: "http://127.0.0.1:2", models: [m], memory_source: kv}',
    )
    p = make_policy(redis_server.url, text)
    assert decode_limit_s(p) == decode_limit_s(p, 90) == pytest.approx(0.060)  # short answers
    assert decode_limit_s(p, 300) == pytest.approx(0.030)  # 9 s for 300 tokens
    assert decode_limit_s(p, 5000) == pytest.approx(0.030)  # never below half of tpot_ms
    assert decode_limit_s(make_policy(redis_server.url)) is None  # no tpot target: no guard
    v, w = (
        NodeView(p.nodes[n], state=Status.OPEN, per_token=0.0001, prefill_rate=1000.0)
        for n in ("n1", "n2")
    )
    w.ledger(0.0, 50, 1, 0.0, urgent=50, reserve=50.0)  # realtime runs on n2 (KV booked)
    v.tpot_s = 0.040  # what lower-class prefill chunks leave realtime's decode now

    def batch_on_n1(**kw: float) -> bool:
        return any(
            n is v
            for n, _ask in eligible(
                [v, w], p, Request("m", "batch", 10, 20), ClusterFacts(0.0, **kw)
            )
        )

    assert batch_on_n1()  # within 60 ms
    assert not batch_on_n1(output_tokens=300)  # 40 > 30 ms
    assert eligible(
        [v], p, Request("m", "realtime", 10, 20), ClusterFacts(0.0, output_tokens=300)
    )  # never itself
    # Realtime nowhere (no KV booked on any node, none waiting): nothing to protect, lower
    # classes take the node's whole decode; it waiting is enough to bring the guard back.
    w.ledger(0.0, 0, 0, 0.0, urgent=0, reserve=0.0)
    assert batch_on_n1(output_tokens=300)
    assert not batch_on_n1(output_tokens=300, urgent_waiting=10)

    o = AnswerLengths()
    o.answered("t0", 100)  # not admitted here (or not urgent): not counted
    assert o.mean == 0
    o.admitted("t0", urgent=False)  # batch: not learned from
    o.answered("t0", 100)
    assert o.mean == 0
    for i in range(MAX_OPEN + 1):
        o.admitted(f"t{i}", urgent=True)
    o.answered("t0", 100)  # forgotten: the oldest beyond MAX_OPEN
    o.answered("t1", -1)  # the engine reported no usage
    assert o.mean == 0
    o.answered("t2", 100)
    o.answered("t3", 300)
    assert o.mean == pytest.approx(0.95 * 100 + 0.05 * 300)


def test_the_urgent_class_that_refuses_late_waits_off_a_node_where_it_would_finish_late(
    redis_server: RedisServer,
) -> None:
    # Realtime (until drain, e2e 10 s, TTFT 1 s, tpot 60 ms) that refuses late: a node whose
    # running requests see more than the looser of tpot_ms and what e2e asks of answers as long
    # as realtime's are (120 tokens: 75 ms) takes none of it; it waits, and is refused early.
    from admission.scheduling.answer_lengths import own_decode_limit_s

    slo = "slo: {ttft_ms: 1000, e2e_ms: 10000, tpot_ms: 60}"
    serves_late = BASE_POLICY.replace(
        "deadline_s: 5}", f"deadline_s: 5, admit_until: drain, {slo}}}"
    )
    refuses = serves_late.replace(f"{slo}}}", f"{slo}, on_late: refuse}}")
    p, q = make_policy(redis_server.url, refuses), make_policy(redis_server.url, serves_late)
    assert own_decode_limit_s(p, "realtime", 120) == pytest.approx(0.075)
    assert own_decode_limit_s(p, "realtime", 300) == pytest.approx(0.060)  # tpot_ms the looser
    assert own_decode_limit_s(p, "realtime", 0) is None  # answers' length not learned yet
    assert own_decode_limit_s(q, "realtime", 120) is None  # serves late: vLLM runs it first
    assert own_decode_limit_s(p, "batch", 120) is None  # lower classes: decode_limit_s
    v = NodeView(p.nodes["n1"], state=Status.OPEN, per_token=0.0001, prefill_rate=1000.0)

    def realtime(policy: Policy, tpot_s: float, out: float = 120, refusing: bool = True) -> bool:
        v.tpot_s = tpot_s
        return bool(
            eligible(
                [v],
                policy,
                Request("m", "realtime", 10, 20),
                ClusterFacts(0.0, output_tokens=out, refusing=refusing),
            )
        )

    assert realtime(p, 0.070) and not realtime(p, 0.080)
    assert realtime(p, 0.080, refusing=False)  # not refused late lately: within capacity
    # The last sample's 80 ms was a long prefill step: answers saw 30 ms a token over the last
    # second (under half the limit), so the node serves it in time; at 40 ms it is held again.
    # Lower classes keep judging by the last sample (the urgent class's margin).
    v.decode_s = 0.030
    assert realtime(p, 0.080)
    assert not eligible(
        [v],
        p,
        Request("m", "batch", 10, 20),
        ClusterFacts(0.0, urgent_waiting=100, output_tokens=120),
    )
    v.decode_s = 0.040
    assert not realtime(p, 0.080)
    v.decode_s = None  # an agent that predates it: the last sample decides
    assert realtime(p, 0.080, out=0)  # nothing learned: no guard
    assert realtime(q, 0.500)  # a class that serves late is never held by decode
    gate: Counter[tuple[str, str, str]] = Counter()
    eligible(
        [v],
        p,
        Request("m", "realtime", 10, 20),
        ClusterFacts(0.0, output_tokens=120, refusing=True),
        gate,
    )
    assert gate == {("n1", "realtime", "decode"): 1}
    # While refusing, its prefill budget is what is left of its 1 s target after its wait: a
    # node whose booked prefill (600 tokens at 1,000/s) would put its first token past the
    # target takes it no more; within capacity the whole target (the ledger's estimates err long).
    v.tpot_s = 0.0
    v.ledger(600.0, 0, 1, 0.0, urgent=0, reserve=0.0)

    def budget(waited_s: float, refusing: bool = True) -> int | None:
        got = eligible(
            [v],
            p,
            Request("m", "realtime", 10, 20, waited_s=waited_s),
            ClusterFacts(0.0, refusing=refusing),
        )
        return got[0][1].prefill_budget if got else None

    assert budget(0.0) == 1000 and budget(0.2) == 800
    assert budget(0.5) is None  # 600 booked + 10 > 500 left: it waits
    assert budget(0.5, refusing=False) == 1000
    # Past its target: a budget of 1 token (0 would mean "not gated" to lease.lua).
    assert (
        ask_for(v, p, Request("m", "realtime", 10, 20, waited_s=5.0), decode_s=None).prefill_budget
        == 1
    )


def test_lower_classes_leave_the_urgent_reserve_free(redis_server: RedisServer) -> None:
    # 1,000 KV tokens; hold 0.80 = 800, drain 0.85 = 850. Realtime (admitted until drain) is
    # not held by the reserve; batch keeps its KV + max(realtime's recent peak, what realtime
    # holds + what of it waits) below 850.
    text = BASE_POLICY.replace("deadline_s: 5}", "deadline_s: 5, admit_until: drain}")
    p = make_policy(redis_server.url, text)
    v = NodeView(p.nodes["n1"], state=Status.OPEN, per_token=0.001)

    def ok(cls: str, kv: int, waiting: int = 0) -> bool:
        return bool(
            eligible([v], p, Request("m", cls, 10, kv), ClusterFacts(0.0, urgent_waiting=waiting))
        )

    assert ok("batch", 600)  # no reserve yet: only the hold watermark
    v.ledger(0.0, 100, 1, 0.0, urgent=100, reserve=300.0)
    assert ok("batch", 550) and not ok("batch", 600)  # 0 + 600 + 300 > 850 (hold: 700 is fine)
    assert ok("realtime", 700)  # realtime is not held by its own reserve
    v.ledger(0.0, 100, 1, 0.0, urgent=100, reserve=100.0)
    assert ok("batch", 650) and not ok("batch", 650, waiting=200)  # 650 + (100 + 200) > 850
    ((_node, ask),) = eligible(
        [v], p, Request("m", "batch", 10, 100), ClusterFacts(0.0, urgent_waiting=200)
    )
    assert ask.reserve_limit == 850 and ask.kv_limit == 800 and not ask.urgent
    assert ask.urgent_waiting == 200  # one live node: all of it
    v.booked(eligible([v], p, Request("m", "realtime", 10, 400), ClusterFacts(0.0))[0][1], 0.0)
    assert v.kv_urgent == 500 and v.reserve == 500  # what this sidecar booked counts at once
    v.ledger(0.0, 500, 1, 20.0)  # a refusal's figures (no reserve): the local one decays on
    assert v.kv_urgent == 500 and v.reserve_now(20.0) == pytest.approx(250.0)  # one half-life


def test_urgent_class_is_not_held_by_what_lower_classes_hold(redis_server: RedisServer) -> None:
    # 1,000 KV tokens, drain 0.85. Batch has booked 700 and measured memory shows it (0.86:
    # drained): realtime still goes — vLLM preempts batch for it — as long as its own KV and
    # what is not KV stay below drain; batch does not.
    text = BASE_POLICY.replace("deadline_s: 5}", "deadline_s: 5, admit_until: drain}")
    p = make_policy(redis_server.url, text)
    v = NodeView(p.nodes["n1"], state=Status.DRAIN, memory=0.86, per_token=0.001)
    v.ledger(0.0, 700, 2, 0.0, urgent=0, reserve=0.0)

    def ok(cls: str, kv: int) -> bool:
        return bool(eligible([v], p, Request("m", cls, 10, kv), ClusterFacts(0.0)))

    assert ok("realtime", 800) and not ok("realtime", 900)  # its own 900 ≥ 850
    assert not ok("batch", 10)
    v.ledger(0.0, 700, 2, 0.0, urgent=700, reserve=700.0)  # realtime's own KV this time
    assert not ok("realtime", 10)  # 0.86 measured, none of it preemptible
    v.ledger(0.0, 100, 1, 0.0, urgent=0, reserve=0.0)
    v.memory, v.base_memory = 0.96, 0.86  # the engine's KV in use is 0.10: the rest is not KV
    assert not ok("realtime", 10)  # (another process, a leak): 0.96 − 0.10 ≥ 0.85
    v.memory, v.base_memory = 0.96, 0.0  # all of it KV, batch's only booking: preemptible up
    assert ok("realtime", 10)  # to 4 × its 0.10 (chars_per_token): 0.96 − 0.40 < 0.85
    v.memory = 0.96
    v.ledger(0.0, 20, 1, 0.0, urgent=0, reserve=0.0)  # booked 0.02: at most 0.08 is batch's,
    assert not ok("realtime", 10)  # the rest traffic the ledger does not see: 0.88 ≥ 0.85
    v.memory, v.state = 0.5, Status.DOWN
    assert not ok("realtime", 10)  # down is down


def test_lower_classes_hold_their_share_of_the_kv_the_engine_measures(
    redis_server: RedisServer,
) -> None:
    # The edge's estimate can be far under the engine's tokens (a real node's tiny model: 3.2
    # for 4 characters). 1,000 KV tokens, drain 0.85; booked 100 realtime + 100 batch, while the
    # engine reports 0.70 in use (memory 0.75, 0.05 not KV): batch holds half of it, 0.35, which
    # vLLM preempts for realtime. Counted by its booking alone (0.10), realtime was held.
    text = BASE_POLICY.replace("deadline_s: 5}", "deadline_s: 5, admit_until: drain}")
    p = make_policy(redis_server.url, text)
    assert p.edge.chars_per_token == 4.0
    v = NodeView(p.nodes["n1"], state=Status.DRAIN, memory=0.95, per_token=0.001)
    v.base_memory = 0.05
    v.memory = 0.75
    v.ledger(0.0, 200, 2, 0.0, urgent=100, reserve=100.0)
    assert v.preemptible(4.0) == pytest.approx(0.35)
    assert v.preemptible() == pytest.approx(0.10)  # its booking alone
    v.memory = 0.95  # in use 0.90: half of it is 0.45, past 4 × the booking (a token is rarely
    assert v.preemptible(4.0) == pytest.approx(0.40)  # under a character): the rest not theirs
    assert eligible(
        [v], p, Request("m", "realtime", 10, 10), ClusterFacts(0.0)
    )  # 0.95 − 0.40 < 0.85
    assert not eligible([v], p, Request("m", "batch", 10, 10), ClusterFacts(0.0))
    v.ledger(0.0, 200, 2, 0.0, urgent=190, reserve=190.0)  # realtime's own, nearly all of it
    assert v.preemptible(4.0) == pytest.approx(0.040)
    assert not eligible(
        [v], p, Request("m", "realtime", 10, 10), ClusterFacts(0.0)
    )  # 0.95 − 0.04 ≥ 0.85
    v.memory = 0.15  # in use less than booked: the booking counts (0.01), not its share
    v.ledger(0.0, 200, 2, 0.0, urgent=190, reserve=190.0)
    assert v.preemptible(4.0) == pytest.approx(0.01)


def test_every_node_that_says_no_is_counted_with_its_reason(redis_server: RedisServer) -> None:
    from collections import Counter

    from prometheus_client import generate_latest

    from admission.scheduling.gates import GATE_REASONS

    slo = "slo: {ttft_ms: 1000, tpot_ms: 60}"
    text = BASE_POLICY.replace("deadline_s: 5}", f"deadline_s: 5, admit_until: drain, {slo}}}")
    p = make_policy(redis_server.url, text)
    v = NodeView(p.nodes["n1"], state=Status.OPEN, per_token=0.001, prefill_rate=1000.0)
    gate: Counter[tuple[str, str, str]] = Counter()

    def no(cls: str, kv: int = 10, prompt: int = 10, waiting: int = 0) -> str:
        gate.clear()
        assert not eligible(
            [v], p, Request("m", cls, prompt, kv), ClusterFacts(0.0, urgent_waiting=waiting), gate
        )
        ((node, c, reason),) = gate
        assert node == "n1" and c == cls and reason in GATE_REASONS
        return reason

    assert no("batch", kv=850) == "booked"
    assert no("batch", kv=600, waiting=300) == "reserve"
    v.ledger(900.0, 0, 2, 0.0)  # two in flight: their prefill pending
    assert no("batch", prompt=200) == "prefill"  # 900 + 200 > 1,000 tokens/s x 1 s
    v.ledger(50.0, 0, 2, 0.0)
    assert eligible(
        [v], p, Request("m", "batch", 10, 10), ClusterFacts(0.0)
    )  # 50 + 10 within the budget
    v.kv_urgent = v.kv_reserved = 20  # realtime runs there: lower classes get idle prefill only
    assert no("batch") == "prefill"
    v.ledger(0.0, 20, 0, 0.0)
    assert eligible(
        [v], p, Request("m", "batch", 10, 10), ClusterFacts(0.0)
    )  # its pending cleared: one may go
    v.ledger(900.0, 20, 1, 0.0, urgent=20, reserve=20.0)
    v.tpot_s = 1.0
    assert no("batch") == "decode"  # realtime has KV here (the guard needs it somewhere)
    v.kv_urgent = v.kv_reserved = 0
    v.memory = 0.9
    assert no("realtime") == "measured"
    v.state = Status.HOLD
    assert no("batch") == "state"
    v.inflight = v.node.max_inflight
    assert no("realtime") == "inflight"
    m = Metrics()
    m.gate[("n1", "batch", "reserve")] += 2
    assert (
        'admission_node_gate_total{cls="batch",node="n1",reason="reserve"} 2.0'
        in generate_latest(m.registry).decode()
    )
