"""The weighted-fair queue, pure, with an injected clock (no sleeping)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from admission.errors import QueueFull
from admission.policy import Policy, parse_policy
from admission.scheduling.queue import FairQueue, Item

POLICY = """
redis: {{url: "redis://127.0.0.1:1/0"}}
queue: {{max_depth: 100000, max_depth_per_tenant: 50000, long_request_tokens: {long}}}
classes:
  realtime: {{weight: {w0}, min_share: {m0}, priority: 0, deadline_s: 5}}
  batch: {{weight: {w1}, min_share: {m1}, priority: 1, deadline_s: 10, promote_after_s: 2}}
  offline: {{weight: {w2}, min_share: {m2}, priority: 2, deadline_s: 20, promote_after_s: 4}}
tenants:
  a: {{weight: {ta}, keys: ["plain:a"], classes: [realtime, batch, offline], limits: {{requests_per_s: 1, tokens_per_min: 1}}}}
  b: {{weight: {tb}, keys: ["plain:b"], classes: [realtime, batch, offline], limits: {{requests_per_s: 1, tokens_per_min: 1}}}}
  c: {{weight: {tc}, keys: ["plain:c"], classes: [realtime, batch, offline], limits: {{requests_per_s: 1, tokens_per_min: 1, max_queued: 3}}}}
nodes: {{n: {{url: "http://x", models: [m]}}}}
"""


def policy(w=(8, 3, 1), m=(0.0, 0.0, 0.0), t=(5, 3, 1), long: int = 0) -> Policy:
    return parse_policy(
        POLICY.format(
            w0=w[0],
            w1=w[1],
            w2=w[2],
            m0=m[0],
            m1=m[1],
            m2=m[2],
            ta=t[0],
            tb=t[1],
            tc=t[2],
            long=long,
        )
    )


def item(tenant: str, cls: str, cost: int = 100, now: float = 0.0) -> Item:
    return Item(
        tenant=tenant, cls=cls, cost=cost, model="m", enqueued_at=now, deadline_at=now + 1e9
    )


def drain(q: FairQueue, n: int, now: float = 0.0) -> list[Item]:
    out = []
    for _ in range(n):
        it = q.pop(now)
        assert it is not None
        out.append(it)
    return out


@settings(max_examples=10, deadline=None)
@given(
    w=st.tuples(*[st.integers(1, 10)] * 3),
    costs=st.tuples(*[st.sampled_from([100, 300, 1000])] * 3),
)
def test_class_shares_follow_weights_under_saturation(
    w: tuple[int, int, int], costs: tuple[int, int, int]
) -> None:
    p = policy(w=w)
    q = FairQueue(p)
    names = list(p.classes)
    for i, name in enumerate(names):
        for _ in range(4000):
            q.push(item("a", name, costs[i]))
    served: Counter[str] = Counter()
    total = 0
    target = 300_000
    while total < target:
        it = q.pop(0.0)
        assert it is not None
        served[it.cls] += it.cost
        total += it.cost
    for i, name in enumerate(names):
        want = w[i] / sum(w)
        assert abs(served[name] / total - want) <= 0.05 * want + 1000 / target, (served, w)


@settings(max_examples=10, deadline=None)
@given(
    t=st.tuples(*[st.integers(1, 9)] * 2), costs=st.tuples(*[st.sampled_from([50, 200, 500])] * 2)
)
def test_tenant_shares_by_weight_with_token_cost(
    t: tuple[int, int], costs: tuple[int, int]
) -> None:
    q = FairQueue(policy(t=(t[0], t[1], 1)))
    for _ in range(4500):  # enough of both to stay backlogged for the whole measurement
        q.push(item("a", "realtime", costs[0]))
        q.push(item("b", "realtime", costs[1]))
    served: Counter[str] = Counter()
    total = 0
    while total < 200_000:
        it = q.pop(0.0)
        assert it is not None
        served[it.tenant] += it.cost
        total += it.cost
    want_a = t[0] / sum(t)
    assert abs(served["a"] / total - want_a) <= 0.05 * want_a + 1000 / total


def test_min_share_is_guaranteed() -> None:
    q = FairQueue(policy(w=(100, 1, 1), m=(0.0, 0.2, 0.0)))
    for _ in range(2000):
        for name in ("realtime", "batch", "offline"):
            q.push(item("a", name))
    got = Counter(it.cls for it in drain(q, 1000))
    assert got["batch"] == pytest.approx(200, abs=10)
    # offline: weight 1 of the 101 left after batch's 20%
    assert got["offline"] == pytest.approx(1000 * 0.8 / 101, abs=3)


def test_work_conserving_idle_class_is_borrowed() -> None:
    q = FairQueue(policy())
    for _ in range(100):
        q.push(item("a", "batch"))
    out = drain(q, 100)
    assert all(i.cls == "batch" for i in out) and len(q) == 0
    assert q.pop(0.0) is None


def test_idle_class_does_not_bank_credit() -> None:
    q = FairQueue(policy(w=(1, 1, 1)))
    for _ in range(500):
        q.push(item("a", "batch"))
    drain(q, 400)  # realtime idle all along
    for _ in range(100):
        q.push(item("a", "realtime"))
    got = Counter(it.cls for it in drain(q, 100))
    assert got["realtime"] == pytest.approx(50, abs=2)  # 1:1, not a catch-up burst


@settings(max_examples=10, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.sampled_from(["realtime", "batch", "offline"]), st.integers(1, 2000)),
        min_size=50,
        max_size=300,
    )
)
def test_aging_bounds_every_wait(arrivals: list[tuple[str, int]]) -> None:
    """Realtime always backlogged and weighted 1000:1:1 — offline still gets out in bounded time."""
    q = FairQueue(policy(w=(1000, 1, 1)))
    now = 0.0
    offline = []
    for cls, cost in arrivals:
        it = item("a", cls, cost, now)
        q.push(it)
        if cls == "offline":
            offline.append(it)
    for _ in range(5000):
        q.push(item("b", "realtime", 100, now))
    step = 0.01
    waits = {}
    while offline and now < 60:
        now += step
        q.age(now)
        it = q.pop(now)
        q.push(item("b", "realtime", 100, now))  # keep realtime saturated
        if it is not None and it in offline:
            waits[id(it)] = now - it.enqueued_at
            offline.remove(it)
    assert not offline, "an offline request starved"
    assert max(waits.values(), default=0) < 4 + 2 + 30  # promote_after 4 + 2, then realtime share


def test_promotion_moves_up_one_class_at_a_time() -> None:
    q = FairQueue(policy())
    it = item("a", "offline")
    q.push(it)
    assert q.age(3.9) == 0
    assert q.age(4.0) == 1 and it.cls == "batch"
    assert q.age(5.9) == 0
    assert q.age(6.0) == 1 and it.cls == "realtime"
    assert q.depth("realtime") == 1 and q.depth("offline") == 0


def test_long_requests_start_one_class_lower() -> None:
    q = FairQueue(policy(long=1000))
    a, b = item("a", "realtime", 1001), item("a", "realtime", 1000)
    q.push(a)
    q.push(b)
    assert a.cls == "batch" and a.requested_cls == "realtime" and b.cls == "realtime"


def test_bounds_global_and_per_tenant() -> None:
    q = FairQueue(policy())
    for _ in range(3):
        q.push(item("c", "realtime"))
    with pytest.raises(QueueFull) as ei:
        q.push(item("c", "realtime"))
    assert ei.value.scope == "tenant" and ei.value.reason == "queue_full"
    assert len(q) == 3
    q.policy = parse_policy(
        POLICY.format(w0=1, w1=1, w2=1, m0=0, m1=0, m2=0, ta=1, tb=1, tc=1, long=0).replace(
            "max_depth: 100000", "max_depth: 4"
        )
    )
    q.push(item("a", "realtime"))
    with pytest.raises(QueueFull) as ei:
        q.push(item("b", "realtime"))
    assert ei.value.scope == "global"


@settings(max_examples=50, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["push", "pop", "cancel", "age"]),
            st.sampled_from("abc"),
            st.sampled_from(["realtime", "batch", "offline"]),
        ),
        max_size=200,
    )
)
def test_cancel_and_pop_never_leak(ops: list[tuple[str, str, str]]) -> None:
    q = FairQueue(policy())
    live: list[Item] = []
    now = 0.0
    for op, tenant, cls in ops:
        now += 0.5
        if op == "push":
            it = item(tenant, cls, 10 + ord(tenant) + len(live), now)
            try:
                q.push(it)
                live.append(it)
            except QueueFull:
                pass
        elif op == "pop":
            it = q.pop(now)
            if it is not None:
                live.remove(it)
                assert not it.cancelled
                assert not q.cancel(it)  # already dispatched: cancel is a no-op
        elif op == "cancel" and live:
            victim = live.pop(0)
            assert q.cancel(victim)
            assert not q.cancel(victim)
        else:
            q.age(now)
        assert len(q) == len(live)
        assert sorted(i.seq for i in q.items()) == sorted(i.seq for i in live)
        for t in "abc":
            assert q.tenant_depth(t) == sum(1 for i in live if i.tenant == t)
        for c in ("realtime", "batch", "offline"):  # by the class asked for, aged or not
            assert q.waiting_kv(c) == sum(i.cost for i in live if i.requested_cls == c)
    while q.pop(now) is not None:
        pass
    assert len(q) == 0 and q.waiting_kv("realtime") == q.waiting_kv("batch") == 0


def test_eligibility_skips_to_the_next_runnable_request() -> None:
    q = FairQueue(policy())
    blocked = Item("a", "realtime", 10, "big-model", 0.0, 1e9)
    ok = Item("b", "realtime", 10, "m", 0.0, 1e9)
    q.push(blocked)
    q.push(ok)
    assert q.pop(0.0, lambda i: i.model == "m") is ok
    assert q.pop(0.0, lambda i: i.model == "m") is None
    assert len(q) == 1


def test_retry_after_from_drain_rate() -> None:
    q = FairQueue(policy())
    for _ in range(200):
        q.push(item("a", "realtime"))
    for k in range(100):
        q.pop(k * 0.01)  # 100 per second
    assert q.retry_after(500) == pytest.approx(5.0, rel=0.1)


def slo_policy(
    w: tuple[float, float, float] = (8, 3, 1), m: tuple[float, float, float] = (0.1, 0.1, 0.05)
) -> Policy:
    """realtime and batch have TTFT targets; offline has none."""
    text = POLICY.format(
        w0=w[0], w1=w[1], w2=w[2], m0=m[0], m1=m[1], m2=m[2], ta=5, tb=3, tc=1, long=0
    )
    text = text.replace("deadline_s: 5}", "deadline_s: 5, slo: {ttft_ms: 1000}}")
    text = text.replace("promote_after_s: 2}", "promote_after_s: 2, slo: {ttft_ms: 10000}}")
    return parse_policy(text)


def test_class_without_slo_gets_min_share_while_an_slo_class_waits() -> None:
    # By weight offline would get 1/12 of everything (8.3 %) and a quarter of what realtime
    # leaves; with batch missing its deadlines, it gets its 5 % and no more.
    q = FairQueue(slo_policy())
    for _ in range(3000):
        for name in ("realtime", "batch", "offline"):
            q.push(item("a", name))
    got = Counter(it.cls for it in drain(q, 2000))
    assert got["offline"] == pytest.approx(100, abs=5)
    assert got["realtime"] / got["batch"] == pytest.approx(8 / 3, rel=0.05)


@settings(max_examples=25, deadline=None)
@given(
    w=st.tuples(*[st.integers(1, 20)] * 3),
    m=st.tuples(*[st.sampled_from([0.0, 0.05, 0.1, 0.2, 0.3])] * 3),
    slo=st.booleans(),
)
def test_min_share_binds_for_every_class(
    w: tuple[int, int, int], m: tuple[float, float, float], slo: bool
) -> None:
    # Whatever the weights, with every class backlogged, each class gets at least its
    # min_share of the served cost: no class starves beyond its bound.
    p = slo_policy(w, m) if slo else policy(w=w, m=m)
    q = FairQueue(p)
    for _ in range(1500):
        for name in ("realtime", "batch", "offline"):
            q.push(item("a", name))
    got = Counter(it.cls for it in drain(q, 1000))
    for name, share in zip(("realtime", "batch", "offline"), m, strict=True):
        assert got[name] >= share * 1000 - 2, (got, w, m)


def test_class_without_slo_does_not_overtake_a_blocked_slo_class() -> None:
    # batch's head cannot run yet (say its prompt does not fit the nodes' prefill budget);
    # offline must not take that room: it runs only on its own (min_share) turns.
    q = FairQueue(slo_policy())
    for _ in range(50):
        q.push(item("a", "batch"))
        q.push(item("a", "offline"))
    assert q.pop(0.0, lambda it: it.cls != "batch") is None
    q2 = FairQueue(policy())  # no SLOs anywhere: work-conserving as before
    for _ in range(5):
        q2.push(item("a", "batch"))
        q2.push(item("a", "offline"))
    got = q2.pop(0.0, lambda it: it.cls != "batch")
    assert got is not None and got.cls == "offline"


def test_drop_heads_takes_the_late_and_keeps_order() -> None:
    q = FairQueue(slo_policy())
    for t in range(6):
        q.push(item("a" if t % 2 else "b", "batch", now=float(t)))
    dropped = q.drop_heads("batch", lambda it: it.enqueued_at < 3.0)
    assert sorted(it.enqueued_at for it in dropped) == [0.0, 1.0, 2.0]
    assert len(q) == 3 and q.tenant_depth("a") + q.tenant_depth("b") == 3
    assert sorted(it.enqueued_at for it in drain(q, 3)) == [3.0, 4.0, 5.0] and len(q) == 0


def test_waiting_at_or_above_counts_more_urgent_classes() -> None:
    q = FairQueue(slo_policy())
    q.push(item("a", "batch"))
    q.push(item("a", "offline"))
    assert q.waiting_at_or_above("realtime") == 0  # realtime keeps its fast path
    assert q.waiting_at_or_above("batch") == 1
    assert q.waiting_at_or_above("offline") == 2


def test_requeue_after_its_class_was_removed_does_not_crash() -> None:
    p = policy()
    q = FairQueue(p)
    q.push(item("a", "offline"))
    it = q.pop(0.0)
    assert it is not None
    text = POLICY.format(w0=8, w1=3, w2=1, m0=0, m1=0, m2=0, ta=5, tb=3, tc=1, long=0)
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("  offline:"))
    text = text.replace("classes: [realtime, batch, offline]", "classes: [realtime, batch]")
    q.set_policy(parse_policy(text))
    q.requeue_front(it)  # its lease was refused after the reload
    assert len(q) == 1 and it.cls == "batch"


def _one_each(q: FairQueue, tenants: str, pops: int) -> Counter[str]:
    """Every tenant keeps exactly one request waiting; `pops` pops. The shallowest backlog: a
    tenant's lane empties at each of its pops (as when late refusals drain the lanes)."""
    served: Counter[str] = Counter()
    for t in tenants:
        q.push(item(t, "realtime"))
    for _ in range(pops):
        it = q.pop(0.0)
        assert it is not None
        served[it.tenant] += 1
        q.push(item(it.tenant, "realtime"))
    return served


def test_weights_bind_when_each_tenant_has_one_request_waiting() -> None:
    # A lane that empties used to come back at the class's virtual time, forgetting what its
    # tenant had just been served: with one request each waiting, service went by arrival.
    served = _one_each(FairQueue(policy(t=(5, 3, 1))), "abc", 900)
    assert served == {
        "a": pytest.approx(500, abs=3),
        "b": pytest.approx(300, abs=3),
        "c": pytest.approx(100, abs=3),
    }


def test_a_tenant_idle_a_while_comes_back_at_its_share_without_credit() -> None:
    q = FairQueue(policy(t=(1, 1, 1)))
    _one_each(q, "ab", 400)  # c idle
    late = _one_each(q, "abc", 300)
    assert late["c"] == pytest.approx(100, abs=2)  # its share from now on, no catch-up burst


def test_served_without_waiting_counts_once_a_backlog_forms() -> None:
    q = FairQueue(policy(t=(1, 1, 1)))
    for _ in range(10):  # c served on the fast path while nothing waited
        q.charge(item("c", "realtime"))
    for t in "abc":
        for _ in range(3):
            q.push(item(t, "realtime"))
    first = [it.tenant for it in drain(q, 6)]
    # Its last request counts against it (a and b get one each first); the nine before it do
    # not: no one waited then, and a tenant banks no debt while the queue is empty either.
    assert "c" not in first[:4] and first.count("c") == 1, first


def test_a_refused_lease_gives_back_the_turn_after_the_lane_emptied() -> None:
    q = FairQueue(policy(t=(1, 1, 1)))
    q.push(item("a", "realtime"))
    q.push(item("b", "realtime"))
    it = q.pop(0.0)
    assert it is not None and it.tenant == "a"
    q.requeue_front(it)  # a's lane was emptied by the pop
    assert [i.tenant for i in drain(q, 2)] == ["a", "b"]
