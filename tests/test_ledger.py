"""The node ledger in Redis (lease.lua / unlease.lua), driven by two "sidecars" at once.

Properties: reserved KV is never negative and always equals the sum over live leases (and the
urgent part the sum over urgent ones); a release (or a lease's expiry) always clears its entry;
both clients see one view; the prefill budget, the KV limit and the urgent reserve are enforced
atomically.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from admission.policy import Node
from admission.scheduling import leases
from admission.scheduling.ask import Ask
from admission.scheduling.ticket import make_ticket
from admission.store import Scripts, keys
from devstack.procs import RedisServer

NODE = Node(id="n1", url="http://127.0.0.1:1", models=("m",), max_inflight=8)


def ticket(i: int) -> str:
    return f"{i:016x}:n1:t"


async def fields(redis: Any) -> dict[str, str]:
    return {
        k.decode(): v.decode() for k, v in (await redis.hgetall(keys.node_ledger("n1"))).items()
    }


async def ledger(redis: Any) -> tuple[float, int, dict[str, int]]:
    """(pending, reserved KV, {ticket: KV}); an urgent lease's entry is stored negative."""
    h = await fields(redis)
    entries = {k[2:]: abs(int(v)) for k, v in h.items() if k.startswith("k:")}
    return float(h.get("p", 0)), int(h.get("kv", 0)), entries


ops = st.lists(
    st.tuples(
        st.sampled_from(["take", "give"]),
        st.integers(0, 11),
        st.integers(0, 1),
        st.integers(1, 400),
        st.booleans(),
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops)
def test_ledger_never_negative_always_cleared_and_shared(
    redis_server: RedisServer, ops: list[tuple[str, int, int, int, bool]]
) -> None:
    import redis.asyncio as aioredis

    async def run() -> None:
        clients = [aioredis.Redis.from_url(redis_server.url) for _ in range(2)]
        await clients[0].flushall()
        scripts = [Scripts(c) for c in clients]
        live: dict[str, int] = {}
        hot: set[str] = set()  # urgent leases
        try:
            for op, i, who, tokens, rt in ops:
                t = ticket(i)
                if op == "take":
                    ask = Ask(
                        tokens,
                        tokens * 2,
                        0.0,
                        0,
                        1500,
                        urgent=rt,
                        reserve_limit=-1 if rt else 1600,
                    )
                    res = (await scripts[who].run(leases.take(NODE, t, 60, ask)))[0]
                    granted_lower = leases.granted(res) and not rt
                    if leases.granted(res):
                        live[t] = tokens * 2
                        (hot.add if rt else hot.discard)(t)
                    else:  # a refused retry is left with no booking
                        live.pop(t, None)
                        hot.discard(t)
                else:
                    granted_lower = False
                    await scripts[who].run(leases.give_back(t))
                    live.pop(t, None)
                    hot.discard(t)
                h = await fields(clients[1 - who])  # the other sidecar's view
                _p, kv, entries = await ledger(clients[1 - who])
                urgent_kv = int(h.get("u", 0))
                assert kv >= 0 and urgent_kv >= 0
                assert entries == live
                assert kv == sum(live.values())
                assert urgent_kv == sum(live[t] for t in hot)
                # The KV limit held, atomically: by all of it for a lower class's lease; the
                # urgent class counts only its own KV (vLLM preempts the others for it).
                assert urgent_kv <= 1500
                assert kv <= 1500 or not granted_lower
                assert float(h.get("r", 0)) >= urgent_kv  # the reserve covers what realtime holds
                assert await clients[0].zcard(keys.node_leases("n1")) == len(live)
            for t in list(live):
                await scripts[0].run(leases.give_back(t))
            _p, kv, entries = await ledger(clients[0])
            assert kv == 0 and entries == {} and int((await fields(clients[0])).get("u", 0)) == 0
        finally:
            for c in clients:
                await c.aclose()

    asyncio.run(run())


async def test_expired_leases_leave_the_ledger(redis: Any) -> None:
    s = Scripts(redis)
    await s.run(leases.take(NODE, ticket(1), 0.05, Ask(10, 100)))
    await asyncio.sleep(0.1)
    res = (await s.run(leases.take(NODE, ticket(2), 60, Ask(10, 50))))[0]
    assert leases.granted(res)
    _p, kv, entries = await ledger(redis)
    assert kv == 50 and set(entries) == {ticket(2)}


async def test_prefill_budget_and_drain_by_rate(redis: Any) -> None:
    s = Scripts(redis)
    ask = Ask(900, 1000, prefill_rate=1000.0, prefill_budget=1000)
    assert leases.granted((await s.run(leases.take(NODE, ticket(1), 60, ask)))[0])  # idle: yes
    res = (await s.run(leases.take(NODE, ticket(2), 60, ask)))[0]
    assert leases.refusal(res) is not None and leases.refusal(res)[0] == "prefill"  # type: ignore[index]
    await asyncio.sleep(0.85)  # ~850 of the 900 pending tokens cleared at 1,000 tokens/s
    assert leases.granted((await s.run(leases.take(NODE, ticket(3), 60, ask)))[0])
    unbudgeted = Ask(900, 1000, prefill_rate=1000.0, prefill_budget=0)  # realtime
    assert leases.granted((await s.run(leases.take(NODE, ticket(4), 60, unbudgeted)))[0])
    pending, _kv, _e = await ledger(redis)
    assert 1400 < pending < 1900  # ~1,850, less whatever drained while a busy machine was slow


async def test_a_node_with_no_lease_left_has_nothing_pending_whatever_its_rate(
    redis: Any,
) -> None:
    """Pending prefill is that of requests in flight: with none left the node takes the next at
    once, even where its measured rate (the peak it was given: ~20 tokens/s after short chats one
    at a time) has not drained what it booked. Before, such an idle node stayed "busy" and a
    realtime chat was answered 429 slo_unreachable (tests/test_supervision.py under load)."""
    s = Scripts(redis)
    ask = Ask(900, 1000, prefill_rate=20.0, prefill_budget=20)
    assert leases.granted((await s.run(leases.take(NODE, ticket(1), 60, ask)))[0])  # idle: yes
    res = (await s.run(leases.take(NODE, ticket(2), 60, ask)))[0]
    assert leases.refusal(res)[0] == "prefill"  # type: ignore[index]  # 900 pending at 20/s
    await s.run(leases.give_back(ticket(1)))
    assert leases.granted((await s.run(leases.take(NODE, ticket(3), 60, ask)))[0])


async def test_lower_classes_get_only_idle_prefill_where_the_urgent_class_runs(
    redis: Any,
) -> None:
    """With urgent KV booked on a node, a lower-class ask within its budget still waits until
    the node's pending prefill has cleared; the urgent class itself is never gated by it."""
    s = Scripts(redis)
    batch = Ask(100, 200, prefill_rate=1000.0, prefill_budget=1000)
    assert leases.granted((await s.run(leases.take(NODE, ticket(1), 60, batch)))[0])
    assert leases.granted((await s.run(leases.take(NODE, ticket(2), 60, batch)))[0])  # 200 < 1,000
    await s.run(leases.give_back(ticket(1)))
    await s.run(leases.give_back(ticket(2)))
    await asyncio.sleep(0.25)  # the 200 pending tokens clear at 1,000 tokens/s
    rt = Ask(100, 200, prefill_rate=1000.0, urgent=True)
    assert leases.granted((await s.run(leases.take(NODE, ticket(3), 60, rt)))[0])
    res = (await s.run(leases.take(NODE, ticket(4), 60, batch)))[0]
    assert leases.refusal(res) is not None and leases.refusal(res)[0] == "prefill"  # type: ignore[index]
    assert leases.granted((await s.run(leases.take(NODE, ticket(5), 60, rt)))[0])  # never gated
    await asyncio.sleep(0.3)  # 200 realtime tokens pending clear: the node's prefill is idle
    assert leases.granted((await s.run(leases.take(NODE, ticket(4), 60, batch)))[0])
    res = (await s.run(leases.take(NODE, ticket(6), 60, batch)))[0]  # one at a time
    assert leases.refusal(res) is not None and leases.refusal(res)[0] == "prefill"  # type: ignore[index]
    await s.run(leases.give_back(ticket(3)))
    await s.run(leases.give_back(ticket(5)))  # no urgent KV left: the budget again
    assert leases.granted((await s.run(leases.take(NODE, ticket(6), 60, batch)))[0])


async def test_urgent_reserve_keeps_lower_classes_off_what_realtime_needs(redis: Any) -> None:
    """Lower classes keep their KV + the urgent reserve (realtime's recent peak, or what it has
    plus what of it waits) below the reserve limit; realtime itself is not held by it."""
    s = Scripts(redis)

    def rt(tokens: int) -> Ask:
        return Ask(10, tokens, kv_limit=1000, urgent=True)

    def batch(tokens: int, waiting: int = 0) -> Ask:
        return Ask(10, tokens, kv_limit=900, reserve_limit=1000, urgent_waiting=waiting)

    for i in range(3):  # realtime peaks at 600 tokens
        assert leases.granted((await s.run(leases.take(NODE, ticket(i), 60, rt(200))))[0])
    for i in range(3):
        await s.run(leases.give_back(ticket(i)))
    h = await fields(redis)
    assert int(h["u"]) == 0 and int(h["kv"]) == 0 and float(h["r"]) >= 599
    res = (await s.run(leases.take(NODE, ticket(10), 60, batch(500))))[0]
    assert leases.refusal(res) is not None and leases.refusal(res)[0] == "reserve"  # type: ignore[index]
    assert leases.granted((await s.run(leases.take(NODE, ticket(11), 60, batch(390))))[0])
    # realtime takes its reserve, past what the lower classes may use
    assert leases.granted((await s.run(leases.take(NODE, ticket(12), 60, rt(600))))[0])
    h = await fields(redis)
    assert int(h["u"]) == 600 and int(h["kv"]) == 990
    await s.run(leases.give_back(ticket(12)))
    await s.run(leases.give_back(ticket(11)))
    # what realtime has waiting counts too, beyond its recent peak
    assert leases.granted((await s.run(leases.take(NODE, ticket(13), 60, batch(300, 100))))[0])
    res = (await s.run(leases.take(NODE, ticket(14), 60, batch(10, 700))))[0]
    assert leases.refusal(res) is not None and leases.refusal(res)[0] == "reserve"  # type: ignore[index]


async def test_urgent_class_counts_only_its_own_kv(redis: Any) -> None:
    """Lower classes filled the node up to their limit: realtime is still granted up to its own
    limit (vLLM preempts the lower classes for it), and refused past it by its own KV."""
    s = Scripts(redis)
    for i in range(2):
        ask = Ask(10, 450, kv_limit=900)
        assert leases.granted((await s.run(leases.take(NODE, ticket(i), 60, ask)))[0])
    rt = Ask(10, 600, kv_limit=1000, urgent=True)
    assert leases.granted((await s.run(leases.take(NODE, ticket(5), 60, rt)))[0])  # 1,500 booked
    res = (await s.run(leases.take(NODE, ticket(6), 60, rt)))[0]  # its own 600 + 600 > 1,000
    assert leases.refusal(res) is not None and leases.refusal(res)[0] == "memory"  # type: ignore[index]
    res = (await s.run(leases.take(NODE, ticket(7), 60, Ask(10, 10, kv_limit=900))))[0]
    assert leases.refusal(res) is not None and leases.refusal(res)[0] == "memory"  # type: ignore[index]
    h = await fields(redis)
    assert int(h["kv"]) == 1500 and int(h["u"]) == 600


async def test_urgent_reserve_decays_once_realtime_is_gone(redis: Any) -> None:
    s = Scripts(redis)
    big = Ask(10, 800, kv_limit=1000, urgent=True)
    assert leases.granted((await s.run(leases.take(NODE, ticket(1), 60, big)))[0])
    await s.run(leases.give_back(ticket(1)))
    # rewind the reserve's clock by 40 s (two half-lives): 800 → 200
    h = await fields(redis)
    await redis.hset(keys.node_ledger("n1"), "rt", int(h["rt"]) - 40_000_000)
    batch = Ask(10, 750, kv_limit=900, reserve_limit=1000)
    assert leases.granted((await s.run(leases.take(NODE, ticket(2), 60, batch)))[0])
    assert 190 < float((await fields(redis))["r"]) < 210


async def test_a_lease_that_reaches_redis_after_its_release_books_nothing(redis: Any) -> None:
    """A lease whose reply the sidecar timed out on (the request admitted without it, fail-open)
    may still run in Redis, after the request ended and was released: it must book nothing (a
    lease left until its TTL, tests/test_many_sidecars.py now and then). A lease released in the
    usual order leaves no mark, and the same ticket's undo (not a release) none either."""
    s = Scripts(redis)
    late = make_ticket("d" * 32, "n1", "t")
    await s.run(leases.give_back(late, released=True))  # the release came first
    res = (await s.run(leases.take(NODE, late, 60, Ask(100, 200))))[0]
    assert leases.over(res) == "released"
    assert await redis.zcard(keys.node_leases("n1")) == 0
    _pending, kv, entries = await ledger(redis)
    assert kv == 0 and not entries
    usual = make_ticket("e" * 32, "n1", "t")
    assert leases.granted((await s.run(leases.take(NODE, usual, 60, Ask(100, 200))))[0])
    await s.run(leases.give_back(usual, released=True))
    assert not await redis.zscore(keys.node_gone("n1"), usual)  # found and removed: no mark
    undone = make_ticket("c" * 32, "n1", "t")
    await s.run(leases.give_back(undone))  # an undo: the same ticket may still lease later
    again = (await s.run(leases.take(NODE, undone, 60, Ask(100, 200))))[0]
    assert leases.granted(again) and leases.over(again) == ""


async def test_a_lease_given_back_for_good_is_not_booked_again_by_a_late_copy(
    redis: Any,
) -> None:
    """A lease granted to a request that was then refused, timed out or left is given back for
    good: a copy of its round trip that Redis runs afterwards (the Cluster client sends a timed
    out command again) books nothing — before, it stayed until its TTL. The plain undo leaves
    no mark (test above)."""
    s = Scripts(redis)
    gone = make_ticket("f" * 32, "n1", "t")
    ask = Ask(100, 200)
    assert leases.granted((await s.run(leases.take(NODE, gone, 60, ask)))[0])
    await s.run(leases.give_back(gone, final=True))
    assert await redis.zscore(keys.node_gone("n1"), gone)  # found and removed: marked anyway
    late = (await s.run(leases.take(NODE, gone, 60, ask)))[0]
    assert leases.over(late) == "released"
    assert await redis.zcard(keys.node_leases("n1")) == 0
    _pending, kv, entries = await ledger(redis)
    assert kv == 0 and not entries


async def test_a_lease_asked_again_and_refused_keeps_no_booking(redis: Any) -> None:
    """A lease round trip the sidecar timed out on ran after all; asked again, the lease is
    refused (the node filled meanwhile): the sidecar holds nothing for the request and will
    release nothing, so the first booking must go too. Before, it stayed until its TTL (46
    leases after 6,000 clients, tests/test_overload.py)."""
    s = Scripts(redis)
    first, other = ticket(1), ticket(2)
    big = Ask(10, 800, kv_limit=1000)
    assert leases.granted((await s.run(leases.take(NODE, other, 60, big)))[0])
    for urgent in (False, True):
        ask = Ask(10, 100, kv_limit=1000, urgent=urgent)
        assert leases.granted((await s.run(leases.take(NODE, first, 60, ask)))[0])
        retry = dataclasses.replace(ask, kv_limit=50)  # the node's room shrank meanwhile
        res = (await s.run(leases.take(NODE, first, 60, retry)))[0]
        assert leases.refusal(res) is not None and leases.refusal(res)[0] == "memory"  # type: ignore[index]
        assert await redis.zrange(keys.node_leases("n1"), 0, -1) == [other.encode()]
        _pending, kv, entries = await ledger(redis)
        assert kv == 800 and entries == {other: 800}
        assert int((await fields(redis)).get("u", 0)) == 0


async def test_a_forced_booking_asked_again_after_its_release_books_nothing(redis: Any) -> None:
    """A request answered ahead: its forced booking ran but the reply was lost to a late loop,
    the request ended and was released (on another sidecar), and the booking is asked again —
    once or more. Each retry must book nothing: before, the first retry booked it again (or
    the second, the mark being taken by the first) and the lease stayed until its TTL (9–19
    leases after 1,024–6,000 clients on a loaded machine, tests/test_overload.py)."""
    s = Scripts(redis)
    t = make_ticket("f" * 32, "n1", "t", ahead=True)
    ask = Ask(100, 200)
    assert leases.granted((await s.run(leases.take(NODE, t, 60, ask, force=True)))[0])
    await s.run(leases.give_back(t, released=True))
    for _ in range(2):
        res = (await s.run(leases.take(NODE, t, 60, ask, force=True)))[0]
        assert leases.over(res) == "released"
    assert await redis.zcard(keys.node_leases("n1")) == 0
    _pending, kv, entries = await ledger(redis)
    assert kv == 0 and not entries
