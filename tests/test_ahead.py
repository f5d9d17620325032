"""Answering ahead of the Redis round trip (scheduling/answer_ahead.py): the answer does not wait for
Redis when the last figures show room for one more; Redis still books every request, a release
never overtakes its booking, and what went past a limit is booked, counted and paid back."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from redis import exceptions as rex

from admission.errors import Throttled
from admission.policy import Policy
from admission.scheduling import Dispatcher, leases
from admission.scheduling.answer_ahead import MAX_OUT
from admission.scheduling.ask import Ask
from admission.scheduling.take_lease import Admission
from admission.scheduling.ticket import answered_ahead, make_ticket, parse_ticket
from admission.store import Call, keys
from devstack.procs import RedisServer
from tests.test_dispatcher import make
from tests.test_limiter import make_limiter, tenant_policy


def one(d: Dispatcher, p: Policy) -> Coroutine[Any, Any, Admission]:
    """The request every test here sends: tenant t1, realtime, 10 prompt + 40 output tokens."""
    return d.admit(p.tenants["t1"], "realtime", "m", 10, 40)


def ahead(d: Dispatcher, result: str) -> float:
    v = d.metrics.registry.get_sample_value("admission_ahead_total", {"result": result})
    return v or 0.0


async def waits_for_redis(d: Dispatcher, p: Policy) -> Admission:
    """Send `one` request with Redis held: its answer must wait for the round trip."""
    gate = Gate(d)
    task = asyncio.ensure_future(one(d, p))
    await asyncio.sleep(0.1)
    assert not task.done()
    gate.open.set()
    return await task


class Gate:
    """Holds every Redis script round trip of a dispatcher until opened (or fails them)."""

    def __init__(self, d: Dispatcher) -> None:
        self.scripts = d.store.scripts
        self.run = self.scripts.run
        self.open = asyncio.Event()
        self.fail = False
        self.scripts.run = self.held  # type: ignore[method-assign]

    async def held(self, *calls: Call, **kw: Any) -> list[Any]:
        await self.open.wait()
        if self.fail:
            raise rex.ConnectionError("Connection reset by peer")
        return await self.run(*calls, **kw)


async def test_with_room_the_answer_does_not_wait_for_redis_and_the_release_waits_for_it(
    redis: Any, redis_server: RedisServer
) -> None:
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    d, client = make(p)
    first = await one(d, p)  # no figures yet: waits for Redis
    assert ahead(d, "confirmed") == 0 and await redis.zcard(keys.node_leases("n1")) == 1
    gate = Gate(d)
    second = await asyncio.wait_for(one(d, p), 1.0)
    assert second.node == "n1"
    assert await redis.zcard(keys.node_leases("n1")) == 1  # answered before Redis booked it
    release = asyncio.ensure_future(d.release(second.ticket, 20))
    await asyncio.sleep(0.1)
    assert not release.done()  # a release never reaches Redis before its booking
    gate.open.set()
    assert await release == 30  # booked with its 50-token reservation, then settled
    assert ahead(d, "confirmed") == 1
    assert await redis.zscore(keys.node_leases("n1"), second.ticket) is None
    assert await redis.zscore(keys.node_leases("n1"), first.ticket) is not None
    rid, _node, _t = parse_ticket(second.ticket)
    assert not await redis.exists(keys.tenant_keys("t1", rid)[4])  # its reservation settled
    await client.aclose()


async def test_without_room_for_one_more_the_answer_waits(
    redis: Any, redis_server: RedisServer
) -> None:
    # Burst 2: after the first, one request is left, not two: the next waits for Redis.
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 0.01, request_burst: 2, tokens_per_min: 60000}"
    )
    d, client = make(p)
    await one(d, p)
    await waits_for_redis(d, p)
    with pytest.raises(Throttled):
        await one(d, p)
    assert ahead(d, "confirmed") == 0
    await client.aclose()


async def test_the_headers_figures_never_rise_while_answers_go_ahead_of_redis(
    redis: Any, redis_server: RedisServer
) -> None:
    # requests_per_s 0.01: nothing refills in the test. Each answer let through ahead of its
    # debit takes one request off the figures the next answer carries (issue 63).
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 0.01, request_burst: 20, tokens_per_min: 60000}"
    )
    d, client = make(p)
    tenant = p.tenants["t1"]
    await one(d, p)
    seen = [d.limiter.headroom(tenant)["requests_remaining"]]
    gate = Gate(d)
    for _ in range(3):
        await asyncio.wait_for(one(d, p), 1.0)
        seen.append(d.limiter.headroom(tenant)["requests_remaining"])
    gate.open.set()
    await asyncio.sleep(0.2)
    seen.append(d.limiter.headroom(tenant)["requests_remaining"])
    assert seen == [19, 18, 17, 16, 16], seen
    await client.aclose()


async def test_a_requests_refusal_reports_the_token_bucket_as_it_is(
    redis: Any, redis_server: RedisServer
) -> None:
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 0.01, request_burst: 1, tokens_per_min: 60000}"
    )
    d, client = make(p)
    tenant = p.tenants["t1"]
    await one(d, p)
    with pytest.raises(Throttled) as refused:
        await one(d, p)
    rl = (
        refused.value.ratelimit
        if refused.value.ratelimit
        else d.limiter.headroom(tenant, "requests_per_s")
    )
    assert rl["requests_remaining"] == 0
    assert 0 < rl["tokens_remaining"] < 60000, rl  # the first request took 50 (1,000/s refill)
    assert rl["tokens_reset_s"] > 0
    assert not d.limiter.room_ahead(tenant, 1)  # after a refusal, every answer waits for Redis
    await client.aclose()


async def test_policy_can_make_every_answer_wait(redis: Any, redis_server: RedisServer) -> None:
    p = tenant_policy(
        redis_server.url,
        "{requests_per_s: 100, tokens_per_min: 60000}",
        redis_extra=", answer_ahead: false",
    )
    assert not p.redis.answer_ahead
    d, client = make(p)
    await one(d, p)
    await waits_for_redis(d, p)
    await client.aclose()


async def test_a_limit_another_sidecar_reached_first_is_booked_counted_and_paid_back(
    redis: Any, redis_server: RedisServer
) -> None:
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 0.01, request_burst: 4, tokens_per_min: 60000}"
    )
    a, ca = make(p)
    b, cb = make(p)
    await one(a, p)  # A's figures: 3 left
    for _ in range(3):
        await one(b, p)  # B takes them
    over = await one(a, p)  # A still sees room: answered ahead
    await a.ahead.settled([over.ticket])
    assert ahead(a, "over_limits") == 1 and ahead(a, "confirmed") == 0
    # Booked anyway (Redis holds what runs), the bucket in debt: the next is refused.
    assert await redis.zcard(keys.node_leases("n1")) == 5
    level = int(await redis.hget(keys.tenant_keys("t1", "x")[0], "l"))
    assert level < 0
    with pytest.raises(Throttled):
        await one(a, p)
    await ca.aclose()
    await cb.aclose()


async def test_redis_failing_after_the_answer_gives_the_lease_back(
    redis: Any, redis_server: RedisServer
) -> None:
    p: Policy = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    d, client = make(p)
    await one(d, p)
    gate = Gate(d)
    gate.fail = True
    adm = await one(d, p)
    gate.open.set()
    await d.ahead.settled([adm.ticket])
    assert ahead(d, "unconfirmed") == 1
    assert len(d.store.backlog) >= 1  # the lease (it may have run) and the refund are owed
    gate.scripts.run = gate.run  # type: ignore[method-assign]
    assert await d.store.backlog.flush()
    assert await redis.zscore(keys.node_leases("n1"), adm.ticket) is None
    # Not ahead while Redis counts as down: the next admission is decided (fail-open) locally.
    assert not d.limiter.room_ahead(p.tenants["t1"], 50)
    await client.aclose()


async def test_forced_lease_books_past_the_node_limit_and_names_it(
    redis: Any, redis_server: RedisServer
) -> None:
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    lim, client = await make_limiter(p)
    node = p.nodes["n1"]
    one = Ask(prompt_tokens=10, kv_tokens=50)
    for i in range(node.max_inflight):
        assert leases.granted(
            (await lim.store.scripts.run(leases.take(node, f"r{i}:n1:t1", 60, one)))[0]
        )
    refused = (await lim.store.scripts.run(leases.take(node, "x:n1:t1", 60, one)))[0]
    assert leases.refusal(refused) is not None and leases.refusal(refused)[0] == "inflight"  # type: ignore[index]
    forced = (await lim.store.scripts.run(leases.take(node, "y:n1:t1", 60, one, force=True)))[0]
    assert leases.granted(forced) and leases.over(forced) == "inflight"
    assert await redis.zcard(keys.node_leases("n1")) == node.max_inflight + 1
    assert int(await redis.hget(keys.node_ledger("n1"), "kv")) == 50 * (node.max_inflight + 1)
    await client.aclose()


async def test_forced_acquire_debits_past_the_limits_and_reports_the_figures(
    redis: Any, redis_server: RedisServer
) -> None:
    p = tenant_policy(
        redis_server.url,
        "{requests_per_s: 0.01, request_burst: 1, tokens_per_min: 60000, max_concurrent: 3}",
    )
    lim, client = await make_limiter(p)
    t1 = p.tenants["t1"]
    first = await lim.acquire(t1, "a", 10, 60)
    assert first.denied is None and first.over == ""
    assert not lim.room_ahead(t1, 10)  # 0 requests left: no room for two
    assert (await lim.acquire(t1, "b", 10, 60)).denied is not None
    forced = await lim.acquire(t1, "c", 10, 60, force=True)
    assert forced.denied is None and forced.over == "requests_per_s"
    assert int(await redis.zcard(keys.tenant_keys("t1", "x")[3])) == 2  # both running
    level = int(await redis.hget(keys.tenant_keys("t1", "x")[0], "l"))
    assert -1_000_000 <= level < -990_000  # one request in debt (a few ms of refill)
    await client.aclose()


async def test_a_release_at_another_sidecar_before_the_booking_leaves_nothing_booked(
    redis: Any, redis_server: RedisServer
) -> None:
    # The edge may send a release to any sidecar: here it reaches B while A's booking of the
    # request it answered ahead is still on its way. The booking must then book nothing (no
    # lease held for its TTL) and charge what the request used.
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 100, tokens_per_min: 6, token_burst: 100000}"
    )
    a, ca = make(p)
    b, cb = make(p)
    first = await one(a, p)
    await a.release(first.ticket, 50)
    tokens_before = int(await redis.hget(keys.tenant_keys("t1", "x")[1], "l"))
    gate = Gate(a)
    adm = await one(a, p)  # answered ahead, booking held
    assert await b.release(adm.ticket, 7) == 0  # B finds nothing to settle yet
    gate.open.set()
    await a.ahead.settled([adm.ticket])
    assert await redis.zcard(keys.node_leases("n1")) == 0
    assert int(await redis.hget(keys.node_ledger("n1"), "kv")) == 0
    rid, _node, _t = parse_ticket(adm.ticket)
    assert not await redis.exists(keys.tenant_keys("t1", rid)[4])  # nothing reserved
    tokens_after = int(await redis.hget(keys.tenant_keys("t1", "x")[1], "l"))
    assert tokens_before - tokens_after == pytest.approx(7_000_000, abs=20_000)  # what it used
    assert ahead(a, "confirmed") == 1 and ahead(a, "over_node") == 0
    # An undo (not a release) leaves no mark: a later booking of that ticket books.
    await redis.delete(keys.node_gone("n1"))
    assert await redis.zcard(keys.node_gone("n1")) == 0
    await b.store.scripts.run(leases.give_back("zzzzzzzz:n1:t1"))
    assert await redis.zcard(keys.node_gone("n1")) == 0
    await ca.aclose()
    await cb.aclose()


def test_a_ticket_answered_ahead_is_marked_and_parses() -> None:
    t = make_ticket("abcdefgh", "n1", "t1", ahead=True)
    assert t == "abcdefgh:n1:t1:a" and answered_ahead(t)
    assert parse_ticket(t) == ("abcdefgh", "n1", "t1")
    assert not answered_ahead(make_ticket("abcdefgh", "n1", "t1"))
    for bad in ("abcdefgh:n1:t1:b", "abcdefgh:n1:t1:a:a", "abcdefgh:n1"):
        with pytest.raises(ValueError):
            parse_ticket(bad)


async def test_a_sidecar_lets_through_ahead_at_most_half_the_room_it_sees(
    redis: Any, redis_server: RedisServer
) -> None:
    # A node with 12 slots, 1 taken: this sidecar may have 2 out unbooked, not 3. The third
    # would see 3 in flight and need room for 4 more (itself and as much again as it then has
    # out), and 3 + 4 is past half the cap: what other sidecars take meanwhile is not in its view.
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    d, client = make(p)
    v = d.nodes.views["n1"]
    v.node = dataclasses.replace(v.node, max_inflight=12)
    await one(d, p)
    gate = Gate(d)
    for _ in range(2):
        await asyncio.wait_for(one(d, p), 1.0)
    third = asyncio.ensure_future(one(d, p))
    await asyncio.sleep(0.1)
    assert not third.done()
    gate.open.set()
    await third
    assert await redis.zcard(keys.node_leases("n1")) == 4
    assert ahead(d, "confirmed") == 2
    await client.aclose()


async def test_bookings_out_are_bounded_so_a_flood_waits_for_redis(
    redis: Any, redis_server: RedisServer
) -> None:
    # The waited round trip is the sidecar's backpressure: past MAX_OUT bookings on their way,
    # admissions wait for Redis again instead of piling up bookings behind each other.
    p = tenant_policy(
        redis_server.url,
        "{requests_per_s: 100000, tokens_per_min: 100000000, token_burst: 100000000}",
    )
    d, client = make(p)
    v = d.nodes.views["n1"]
    v.node = dataclasses.replace(v.node, max_inflight=100_000)
    await one(d, p)
    gate = Gate(d)
    for _ in range(MAX_OUT):
        await asyncio.wait_for(one(d, p), 1.0)
    more = asyncio.ensure_future(one(d, p))
    await asyncio.sleep(0.1)
    assert not more.done()
    gate.open.set()
    await more
    assert ahead(d, "confirmed") == MAX_OUT
    assert await redis.zcard(keys.node_leases("n1")) == MAX_OUT + 2
    await client.aclose()


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "release", "release", "gate"]),
        st.integers(0, 1),
        st.integers(0, 7),
    ),
    min_size=1,
    max_size=30,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops)
# Always run: A answers ahead with its round trips held, and B gets that request's release first.
@example(ops=[("admit", 0, 0), ("gate", 0, 0), ("admit", 0, 0), ("release", 1, 1)])
def test_whatever_the_order_nothing_stays_booked(
    redis_server: RedisServer, ops: list[tuple[str, int, int]]
) -> None:
    # Two sidecars; admissions, releases sent to either one, and each sidecar's Redis round
    # trips held and let go, in any order: once everything has been released, no lease, KV,
    # concurrency slot or reservation is left in Redis — whether each answer went ahead of its
    # booking or waited for it, and whether a release overtook a booking.
    import redis.asyncio as aioredis

    async def run() -> None:
        p = tenant_policy(redis_server.url, "{requests_per_s: 1000, tokens_per_min: 6000000}")
        r = aioredis.Redis.from_url(redis_server.url)
        await r.flushall()
        made = [make(p) for _ in range(2)]
        gates = [Gate(d) for d, _c in made]
        for g in gates:
            g.open.set()
        admitted: list[str] = []
        tasks: list[asyncio.Future[Any]] = []

        def keep(f: asyncio.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is None:
                admitted.append(f.result().ticket)

        try:
            for op, who, i in ops:
                d = made[who][0]
                if op == "admit":
                    t = asyncio.ensure_future(one(d, p))
                    t.add_done_callback(keep)
                    tasks.append(t)
                elif op == "release" and admitted:
                    tasks.append(
                        asyncio.ensure_future(d.release(admitted.pop(i % len(admitted)), 20))
                    )
                elif op == "gate":
                    (gates[who].open.clear if gates[who].open.is_set() else gates[who].open.set)()
                await asyncio.sleep(0.003)  # an open gate's round trip completes meanwhile
            for g in gates:
                g.open.set()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            for ticket in admitted:
                await made[0][0].release(ticket, 20)
            for d, _c in made:
                await d.ahead.close()
            assert await r.zcard(keys.node_leases("n1")) == 0
            h = await r.hgetall(keys.node_ledger("n1"))
            assert int(h.get(b"kv", 0)) == 0 and not [k for k in h if k.startswith(b"k:")], h
            assert await r.zcard(keys.tenant_keys("t1", "x")[3]) == 0  # concurrency slots
            left = [k for k in await r.keys(b"adm:{t:t1}:res:*") if await r.hexists(k, "tok")]
            assert not left, left
        finally:
            await r.aclose()
            for _d, c in made:
                await c.aclose()

    asyncio.run(run())


async def test_a_stale_view_can_pass_a_node_cap_and_it_is_booked_and_counted(
    redis: Any, redis_server: RedisServer
) -> None:
    # The margin makes it rare, not impossible: B fills the node through Redis (waited path)
    # while A's view still shows it nearly empty. A's answer ahead is booked past the cap, so
    # the ledger holds what runs, counted as over_node; A's view then shows the node full.
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    waits = tenant_policy(
        redis_server.url,
        "{requests_per_s: 100, tokens_per_min: 60000}",
        redis_extra=", answer_ahead: false",
    )
    a, ca = make(p)
    b, cb = make(waits)
    for d in (a, b):
        v = d.nodes.views["n1"]
        v.node = dataclasses.replace(v.node, max_inflight=10)
    await one(a, p)  # A's view: 1 in flight
    for _ in range(9):
        await one(b, waits)  # Redis lets B fill the node: 10 of 10
    late = await one(a, p)  # A's view has room for twice: answered ahead
    await a.ahead.settled([late.ticket])
    assert await redis.zcard(keys.node_leases("n1")) == 11
    assert ahead(a, "over_node") == 1 and ahead(a, "confirmed") == 0
    assert a.nodes.views["n1"].inflight >= 11  # the next decision sees the node over its cap
    await ca.aclose()
    await cb.aclose()
