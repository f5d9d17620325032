"""A sidecar whose cost does not grow with the cluster: the change feed, the bounded refresh,
and routing that examines a bounded few nodes (issue: scale)."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from redis import exceptions as rex

from admission.limits import Limiter
from admission.metrics import Metrics
from admission.nodes import feed
from admission.nodes.feed import Publisher
from admission.nodes.state import NodeState, Status
from admission.policy import FailureMode, Policy, parse_policy
from admission.scheduling import Dispatcher
from admission.scheduling.ask import Request
from admission.scheduling.candidates import EXAMINE, MAX_EXAMINE, PREFIX_NODES, Candidates
from admission.scheduling.prefixes import Prefix
from admission.scheduling.refresh_reads import SWEEP, TOUCHED
from admission.scheduling.routing import ClusterFacts, eligible
from admission.scheduling.views import NodeView
from admission.store import Store, connect, keys
from devstack.procs import RedisServer

POLICY = """
version: 1
redis: {{url: "{url}", command_timeout_ms: 500}}
watermarks: {{stale_after_s: 2}}
classes:
  realtime: {{weight: 8, priority: 0, deadline_s: 5, slo: {{ttft_ms: 1000}}}}
  batch: {{weight: 1, priority: 1, deadline_s: 10}}
tenants:
  acme:
    keys: ["plain:sk-acme"]
    classes: [realtime, batch]
    limits: {{requests_per_s: 100000, request_burst: 100000, tokens_per_min: 1000000000, token_burst: 100000000}}
nodes:
{nodes}
"""


def big_policy(url: str, n: int) -> Policy:
    nodes = "\n".join(
        f'  n{i}: {{url: "http://127.0.0.1:{10000 + i}", models: [m], memory_source: kv,'
        " max_inflight: 64}"
        for i in range(n)
    )
    return parse_policy(POLICY.format(url=url, nodes=nodes))


def state(node: str, st: Status = Status.OPEN, memory: float = 0.2) -> NodeState:
    return NodeState(
        node=node, seq=1, state=st, source="kv", healthy=True, memory=memory, prefill_rate=10_000
    )


def sidecar(p: Policy, clock: Any = None) -> tuple[Dispatcher, Any]:
    client = connect(p.redis)
    st = Store.over(client, Metrics())
    metrics = Metrics()
    kw = {"clock": clock} if clock else {}
    return Dispatcher(st, Limiter(st, lambda: p, metrics), lambda: p, metrics, **kw), client


def failing(pipeline: Any, exc: Exception) -> Any:
    """`pipeline` (a client's), with every pipeline it makes raising `exc` on execute."""

    def make(*args: Any, **kw: Any) -> Any:
        pipe = pipeline(*args, **kw)

        async def execute(*_a: Any, **_k: Any) -> Any:
            raise exc

        pipe.execute = execute
        return pipe

    return make


async def publish(redis: Any, pub: Publisher, states: list[NodeState], now: float) -> None:
    pipe = redis.pipeline(transaction=False)
    pub.publish(pipe, states, now, 2.0)
    await pipe.execute()


async def published(
    redis: Any, redis_server: RedisServer, n: int, now: list[float]
) -> tuple[Dispatcher, Any, list[NodeState]]:
    """A sidecar over `n` nodes on the clock `now[0]`, every node's state published open."""
    a, ca = sidecar(big_policy(redis_server.url, n), clock=lambda: now[0])
    states = [state(f"n{i}") for i in range(n)]
    await publish(redis, Publisher(), states, now[0])
    return a, ca, states


async def commands(redis: Any) -> int:
    return int((await redis.info("stats"))["total_commands_processed"])


async def test_a_change_reaches_every_sidecar_in_one_refresh_whatever_the_size(
    redis: Any, redis_server: RedisServer
) -> None:
    """1,024 nodes: a node far outside the sweep changes state (its agent), is drained by an
    operator on another sidecar, and its agent goes silent — each is seen by the next refresh;
    and a refresh costs Redis the same number of commands with 64 or 1,024 nodes."""
    now = [1000.0]
    p = big_policy(redis_server.url, 1024)
    a, ca = sidecar(p, clock=lambda: now[0])
    b, cb = sidecar(p, clock=lambda: now[0])
    pub = Publisher()
    states = [state(f"n{i}") for i in range(1024)]
    await publish(redis, pub, states, now[0])
    try:
        await a.nodes.refresh()  # the first one reads every node
        await b.nodes.refresh()
        assert all(v.state == Status.OPEN for v in a.views)
        far = "n700"
        states[700] = state(far, Status.DRAIN, 0.9)
        await publish(redis, pub, states, now[0] + 0.2)  # the others unchanged: not news
        await a.nodes.refresh()
        assert a.nodes.get(far).state == Status.DRAIN
        assert a.nodes.get("n701").state == Status.OPEN

        await b.set_maintenance("n900", True)  # an operator, through sidecar b
        await a.nodes.refresh()
        assert a.nodes.get("n900").state == Status.MAINTENANCE
        assert far in a.nodes.unusable and "n900" in a.nodes.unusable

        # Every agent but n5's goes on saying it is alive; n5's falls silent.
        for step in range(1, 12):
            now[0] += 0.25
            alive = [s for s in states if s.node != "n5"]
            await publish(redis, pub, alive, 1000.0 + 0.2 + step * 0.25)
            await a.nodes.refresh()
        assert a.nodes.get("n5").state == Status.DOWN
        assert a.nodes.get("n6").state == Status.OPEN
        assert sum(v.state == Status.DOWN for v in a.views) == 1

        # Commands per refresh while nothing changes: the same at 64 nodes as at 1,024.
        small, cs = sidecar(big_policy(redis_server.url, 64), clock=lambda: now[0])
        await small.nodes.refresh()
        used = {}
        for name, d in (("big", a), ("small", small)):
            before = await commands(redis)
            for _ in range(10):
                await d.nodes.refresh()
            used[name] = (await commands(redis) - before - 1) / 10
        assert used["big"] == used["small"] <= 3 + 6 * SWEEP + 2 * TOUCHED, used
        await cs.aclose()
    finally:
        await ca.aclose()
        await cb.aclose()


async def test_a_full_resync_does_not_skip_a_change_its_key_reads_missed(
    redis: Any, redis_server: RedisServer
) -> None:
    """A full resync reads every state key and the feed's newest entry in one pipeline, which a
    Cluster runs on its masters in any order: an agent's drain can be in the feed read while
    its state key was read before the write. The change must come with the next refresh (not
    with the sweep: n40 is outside the next one's 16 nodes; under load that took 14 s)."""
    now = [1000.0]
    a, ca, _states = await published(redis, redis_server, 64, now)
    try:
        drained = state("n40", Status.DRAIN, 0.9)
        pipe = redis.pipeline(transaction=False)
        feed.add(pipe, "n40", "s", drained.to_json())  # the feed entry, before the key's write
        feed.add(pipe, "n99", "s", state("n99").to_json())  # a node the policy no longer has
        await pipe.execute()
        await a.nodes.refresh()  # the first: a full resync
        assert a.nodes.get("n40").state == Status.OPEN  # the key, as read
        await redis.set(keys.node_state("n40"), drained.to_json(), px=2000)  # the key's write
        now[0] += 0.1
        await a.nodes.refresh()
        assert a.nodes.get("n40").state == Status.DRAIN
    finally:
        await ca.aclose()


async def test_after_a_failed_refresh_the_feed_goes_on_and_a_full_resync_only_if_it_was_trimmed(
    redis: Any, redis_server: RedisServer
) -> None:
    """A failed refresh is not followed by a full resync (every node read: under load it took
    2–4 s and failed again) while the feed still reaches back to where the last good read
    ended; when it does not (trimmed, or Redis restarted empty), the next refresh is full."""
    now = [1000.0]
    a, ca, states = await published(redis, redis_server, 256, now)
    pub = Publisher()
    try:
        await a.nodes.refresh()  # the first: a full resync
        now[0] += 2.0
        a.nodes._refresh_failed()  # a refresh that failed (Redis answered an error)
        age = a.metrics.registry.get_sample_value("admission_node_views_age_seconds")
        assert age == a.nodes.views_age() == 2.0  # (the gauge, and /nodes)
        states[40] = state("n40", Status.DRAIN, 0.9)
        await publish(redis, pub, states, now[0] + 0.1)
        before = await commands(redis)
        await a.nodes.refresh()
        assert a.nodes.get("n40").state == Status.DRAIN  # from the feed
        assert await commands(redis) - before < 256  # not every node's keys (6 a node)
        assert not a.nodes.reads.full
        assert a.nodes.views_age() == 0.0

        a.nodes._refresh_failed()
        await redis.xtrim(keys.node_changes(), maxlen=0)  # what the feed said meanwhile: gone
        states[41] = state("n41", Status.DRAIN, 0.9)
        await publish(redis, pub, states, now[0] + 0.2)
        await a.nodes.refresh()
        assert a.nodes.reads.full  # the next one reads every node
        before = await commands(redis)
        await a.nodes.refresh()
        assert await commands(redis) - before > 6 * 256
        assert a.nodes.get("n41").state == Status.DRAIN
    finally:
        await ca.aclose()


async def test_connections_closed_under_an_overloaded_sidecar_keep_its_views(
    redis: Any, redis_server: RedisServer
) -> None:
    """Reads that fail in place ("Connection closed by server.": redis-py's Cluster client
    closes connections after one timed out) on a sidecar whose loop runs late are its overload:
    the views are kept, however long, and a drained node stays drained. On time, the same is an
    outage, and after stale_after_s the failure mode applies (fail-open: the nodes last seen
    taking work open; the drained one stays closed)."""
    now = [1000.0]
    a, ca, states = await published(redis, redis_server, 64, now)
    states[40] = state("n40", Status.DRAIN, 0.9)
    states[41] = state("n41", Status.HOLD, 0.82)
    await publish(redis, Publisher(), states, now[0])
    real = a.nodes.redis.pipeline

    def closing(*args: Any, **kw: Any) -> Any:
        pipe = real(*args, **kw)
        run = pipe.execute

        async def execute(*a_: Any, **k_: Any) -> Any:
            res = await run(*a_, **k_)
            res[1] = rex.ConnectionError("Connection closed by server.")  # the feed read
            return res

        pipe.execute = execute
        return pipe

    try:
        await a.nodes.refresh()
        assert a.nodes.get("n40").state == Status.DRAIN
        a.nodes.redis.pipeline = closing
        a.nodes.lag.overloaded = lambda: True  # type: ignore[method-assign]
        for _ in range(3):
            now[0] += 2.0
            await a.nodes.refresh()
        assert a.nodes.get("n40").state == Status.DRAIN  # 6 s: kept
        assert a.metrics.registry.get_sample_value(
            "admission_sidecar_overloaded_total", {"op": "refresh"}
        )
        a.nodes.lag.overloaded = lambda: False  # type: ignore[method-assign]
        await a.nodes.refresh()
        assert a.nodes.get("n40").state == Status.DRAIN  # an outage: fail-open, drained kept
        assert a.nodes.get("n41").state == Status.OPEN  # held: opened (nothing measures it)
    finally:
        await ca.aclose()


async def test_a_redis_outage_opens_what_took_work_and_keeps_closed_nodes_closed(
    redis: Any, redis_server: RedisServer
) -> None:
    """Redis gone for longer than stale_after_s: fail-open opens the nodes last seen open or
    held, and keeps a node last seen drained, down (its agent silent) or in maintenance
    closed, as the edge's own fail-open does; the edge's table is not rewritten. Fail-closed
    closes every node. A sidecar that never read a node (started during the outage) opens it.
    Redis back: the agents' states apply again."""
    now = [1000.0]
    a, ca, states = await published(redis, redis_server, 8, now)
    states[1] = state("n1", Status.DRAIN, 0.9)
    states[2] = state("n2", Status.HOLD, 0.82)
    pipe = redis.pipeline(transaction=False)
    Publisher().publish(pipe, [s for i, s in enumerate(states) if i != 3], now[0], 2.0)
    pipe.delete(keys.node_state("n3"))  # its agent is silent: down
    await pipe.execute()
    await a.nodes.set_maintenance("n4", True)
    seen = {n: a.nodes.get(n).state for n in ("n0", "n1", "n2", "n3", "n4")}
    assert seen == {
        "n0": Status.OPEN,
        "n1": Status.DRAIN,
        "n2": Status.HOLD,
        "n3": Status.DOWN,
        "n4": Status.MAINTENANCE,
    }
    told: list[frozenset[str]] = []
    a.nodes.on_unusable = told.append
    real = a.nodes.redis.pipeline
    down = failing(real, rex.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Refused."))
    fresh, cf = sidecar(big_policy(redis_server.url, 8), clock=lambda: now[0])
    try:
        a.nodes.redis.pipeline = fresh.nodes.redis.pipeline = down
        a.nodes.lag.overloaded = lambda: False  # type: ignore[method-assign]
        fresh.nodes.lag.overloaded = lambda: False  # type: ignore[method-assign]
        now[0] += 1.0
        await a.nodes.refresh()
        assert {n: a.nodes.get(n).state for n in seen} == seen  # a blip: the views kept
        now[0] += 3.0
        await a.nodes.refresh()
        await fresh.nodes.refresh()
        assert {n: a.nodes.get(n).state for n in seen} == {
            "n0": Status.OPEN,
            "n1": Status.DRAIN,
            "n2": Status.OPEN,
            "n3": Status.DOWN,
            "n4": Status.MAINTENANCE,
        }
        assert {v.state for v in fresh.nodes.views.values()} == {Status.OPEN}
        assert told == []
        closed = a.nodes.policy()
        closed = replace(closed, redis=replace(closed.redis, failure_mode=FailureMode.CLOSED))
        a.nodes.policy = lambda: closed
        await a.nodes.refresh()
        assert {n: a.nodes.get(n).state for n in seen} == {
            **{n: Status.DOWN for n in ("n0", "n1", "n2", "n3")},
            "n4": Status.MAINTENANCE,
        }
        a.nodes.redis.pipeline = real  # Redis back
        a.nodes.reads.full = True
        await a.nodes.refresh()
        assert {n: a.nodes.get(n).state for n in seen} == seen
    finally:
        await ca.aclose()
        await cf.aclose()


async def test_views_read_late_while_redis_answers_leases_are_kept(
    redis: Any, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The reads fail past stale_after_s (a Redis slow on their pipeline) while Redis answers
    this sidecar's leases: not an outage. The last views are kept in either failure mode (a
    drained node stays drained, fail-closed closes nothing), logged once. No answer to the hot
    path either for stale_after_s: the failure mode applies (here fail-closed: every node down)."""
    now = [1000.0]
    a, ca, states = await published(redis, redis_server, 4, now)
    states[1] = state("n1", Status.DRAIN, 0.9)
    await publish(redis, Publisher(), states, now[0])
    await a.nodes.refresh()
    seen = {n: a.nodes.get(n).state for n in ("n0", "n1", "n2", "n3")}
    assert seen == {"n0": Status.OPEN, "n1": Status.DRAIN, "n2": Status.OPEN, "n3": Status.OPEN}
    p = a.nodes.policy()
    closed = replace(p, redis=replace(p.redis, failure_mode=FailureMode.CLOSED))
    a.nodes.policy = lambda: closed
    adm = await a.admit(p.tenants["acme"], "realtime", "m", 10, 10)  # Redis answers the lease
    real = a.nodes.redis.pipeline
    slow = failing(real, rex.TimeoutError("Timeout reading from 127.0.0.1:6379"))
    a.nodes.lag.overloaded = lambda: False  # type: ignore[method-assign]
    try:
        a.nodes.redis.pipeline = slow
        for _ in range(3):
            now[0] += 1.5
            await a.nodes.refresh()
            assert {n: a.nodes.get(n).state for n in seen} == seen
        assert a.nodes.views_age() >= 4.5  # the gauge (alerted) says how old they are
        said = [r.getMessage() for r in caplog.records if "last views kept" in r.getMessage()]
        assert len(said) == 1 and "TimeoutError" in said[0], said
        a.store.scripts.answered_at -= 3.0  # no answer for stale_after_s (2 s)
        await a.nodes.refresh()
        assert {v.state for v in a.nodes.views.values()} == {Status.DOWN}
    finally:
        a.nodes.redis.pipeline = real
        await a.release(adm.ticket, 20)
        await ca.aclose()


def test_candidates_are_bounded_and_keep_the_best_choice() -> None:
    """On 1,024 nodes of random load, the bounded pick examines at most EXAMINE nodes (+ the
    prefix holders) when enough take the request, and chooses what routing over the whole
    cluster chooses (the least wait) when the order is fresh."""
    p = big_policy("redis://127.0.0.1:1/0", 1024)
    now = 50.0
    rng = random.Random(7)
    for trial in range(20):
        views = []
        for node in p.nodes.values():
            v = NodeView(node)
            v.observe(state(node.id, memory=0.2), False)
            v.ledger(rng.uniform(0, 20_000), rng.randrange(0, 5000), rng.randrange(0, 60), now)
            views.append(v)
        idx = Candidates()
        idx.set_views(views)
        idx.sort(now)
        seen: list[int] = []

        def judge(vs: list[NodeView], seen: list[int] = seen) -> list[Any]:
            seen.append(len(vs))
            return eligible(vs, p, Request("m", "batch", 500, 1000), ClusterFacts(now))

        got = idx.pick("m", [None], [], judge)
        best = eligible(views, p, Request("m", "batch", 500, 1000), ClusterFacts(now))
        assert got and got[0][0].wait_s(now) == best[0][0].wait_s(now), trial
        assert seen == [EXAMINE]

    # When the first ones refuse, it widens, but never past MAX_EXAMINE per pool.
    views = []
    for node in p.nodes.values():
        v = NodeView(node)
        v.observe(state(node.id, memory=0.2), False)
        v.ledger(0.0, 0, 64, now)  # every node at its in-flight cap
        views.append(v)
    idx = Candidates()
    idx.set_views(views)
    idx.sort(now)
    seen = []
    holders = views[500 : 500 + PREFIX_NODES]

    def judge_all(vs: list[NodeView]) -> list[Any]:
        seen.append(len(vs))
        return eligible(
            vs,
            p,
            Request("m", "batch", 500, 1000, prefix=Prefix(("a" * 16,), 16)),
            ClusterFacts(now),
        )

    assert idx.pick("m", [None], holders, judge_all) == []
    assert max(seen) <= MAX_EXAMINE + PREFIX_NODES and len(seen) > 1


async def test_routing_on_eight_nodes_examines_every_node(
    redis: Any, redis_server: RedisServer
) -> None:
    """The bound changes nothing on a small cluster: with 8 nodes, every node is examined
    (the least loaded wins, wherever it sits in the policy)."""
    p = big_policy(redis_server.url, 8)
    d, client = sidecar(p)
    pub = Publisher()
    await publish(redis, pub, [state(f"n{i}") for i in range(8)], 0.0)
    try:
        await d.nodes.refresh()
        for i, v in enumerate(d.views):
            v.ledger(1000.0 * (8 - i), 0, 1, d.clock())  # n7 the least loaded
        found = d.nodes.eligible(Request("m", "batch", 100, 200))
        assert [v.node.id for v, _a in found][:1] == ["n7"] and len(found) == 8
    finally:
        await client.aclose()


def test_the_decode_guard_and_urgent_share_are_the_whole_models_when_candidates_are_few() -> None:
    """Routing judges the few candidates examined; whether the urgent class is present (the
    decode guard) and over how many nodes its waiting KV spreads are the whole model's. A
    candidate without urgent KV must still hold batch off while realtime runs elsewhere."""
    p = big_policy("redis://127.0.0.1:1/0", 16)
    p = type(p)(
        **{
            **p.__dict__,
            "classes": {
                n: (type(c)(**{**c.__dict__, "slo_tpot_ms": 50}) if n == "realtime" else c)
                for n, c in p.classes.items()
            },
        }
    )
    now = 50.0
    v = NodeView(p.nodes["n0"])
    v.observe(
        NodeState(
            node="n0",
            seq=1,
            state=Status.OPEN,
            source="kv",
            healthy=True,
            memory=0.2,
            prefill_rate=10_000,
            tpot_s=0.08,
        ),
        False,
    )
    v.ledger(0.0, 0, 0, now)  # no urgent KV on this candidate
    assert eligible(
        [v], p, Request("m", "batch", 100, 200), ClusterFacts(now)
    )  # alone, nothing to protect
    assert (
        eligible([v], p, Request("m", "batch", 100, 200), ClusterFacts(now, present=True)) == []
    )  # held: decode
