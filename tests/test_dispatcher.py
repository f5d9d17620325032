"""The dispatcher owns the admit decision: what it takes and does not use, it gives back."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from redis import exceptions as rex

from admission import status
from admission.errors import BackendUnavailable, Throttled
from admission.limits import Limiter
from admission.metrics import Metrics
from admission.nodes.state import Status
from admission.policy import Policy
from admission.scheduling import Dispatcher
from admission.scheduling.ask import Ask
from admission.scheduling.priority import BANDS
from admission.scheduling.queue import Item
from admission.scheduling.ticket import make_ticket
from admission.store import Call, Store, connect, keys
from devstack.procs import RedisServer
from tests.conftest import BASE_POLICY, make_policy
from tests.test_limiter import tenant_policy


def make(p: Policy, clock: Callable[[], float] = time.monotonic) -> tuple[Dispatcher, Any]:
    client = connect(p.redis)
    st = Store.over(client, Metrics())
    d = Dispatcher(st, Limiter(st, lambda: p, st.backlog.metrics), lambda: p, Metrics(), clock)
    v = d.nodes.views["n1"]
    v.state = Status.OPEN  # as if its agent had published: the fast path applies
    return d, client


async def test_fast_path_lease_rides_with_the_buckets_and_release_frees_both(
    redis: Any, redis_server: RedisServer
) -> None:
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    d, client = make(p)
    adm = await d.admit(p.tenants["t1"], "realtime", "m", 10, 100 - 10)
    assert adm.node == "n1" and await redis.zcard(keys.node_leases("n1")) == 1
    assert await d.release(adm.ticket, 40) == 60
    assert await redis.zcard(keys.node_leases("n1")) == 0
    await client.aclose()


async def test_denied_request_gives_the_optimistic_lease_back(
    redis: Any, redis_server: RedisServer
) -> None:
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 0.01, request_burst: 1, tokens_per_min: 60000}"
    )
    d, client = make(p)
    await d.admit(p.tenants["t1"], "realtime", "m", 10, 10 - 10)
    with pytest.raises(Throttled):
        await d.admit(p.tenants["t1"], "realtime", "m", 10, 10 - 10)
    assert await redis.zcard(keys.node_leases("n1")) == 1  # only the admitted one
    await client.aclose()


async def test_fail_closed_round_trip_that_ran_leaves_no_lease(
    redis: Any, redis_server: RedisServer
) -> None:
    # Redis slow, not gone: the pipeline carrying buckets + lease ran, but the client timed out.
    # Fail-closed refuses the request, so the lease it may hold must be given back.
    p = tenant_policy(
        redis_server.url,
        "{requests_per_s: 100, tokens_per_min: 60000, max_concurrent: 1}",
        "closed",
    )
    d, client = make(p)
    scripts = d.store.scripts
    run = scripts.run

    async def ran_then_timed_out(*calls: Call, **_kw: Any) -> list[Any]:
        await run(*calls)
        raise rex.TimeoutError("Timeout reading from socket")

    scripts.run = ran_then_timed_out  # type: ignore[method-assign]
    with pytest.raises(BackendUnavailable):
        await d.admit(p.tenants["t1"], "realtime", "m", 10, 50 - 10)
    scripts.run = run  # type: ignore[method-assign]
    assert await redis.zcard(keys.node_leases("n1")) == 1  # it did run
    assert await d.store.backlog.flush()
    assert await redis.zcard(keys.node_leases("n1")) == 0
    assert await redis.zcard(keys.tenant_keys("t1", "a")[3]) == 0  # concurrency slot back
    await client.aclose()


async def test_fail_closed_round_trip_run_after_its_give_back_books_nothing(
    redis: Any, redis_server: RedisServer
) -> None:
    # The other order: the client timed out, the give-back went out on another connection and
    # ran first, and then Redis ran the round trip. The give-back left the released mark, so the
    # late lease books nothing (before, it stayed until lease_ttl_s; tests/test_many_sidecars.py
    # now and then found one left).
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}", "closed")
    d, client = make(p)
    scripts = d.store.scripts
    run = scripts.run
    late: list[Call] = []

    async def timed_out_before_it_ran(*calls: Call, **_kw: Any) -> list[Any]:
        late.extend(calls)
        raise rex.TimeoutError("Timeout reading from socket")

    scripts.run = timed_out_before_it_ran  # type: ignore[method-assign]
    with pytest.raises(BackendUnavailable):
        await d.admit(p.tenants["t1"], "realtime", "m", 10, 50 - 10)
    scripts.run = run  # type: ignore[method-assign]
    assert await d.store.backlog.flush()  # the give-back first ...
    assert any(c.script == "lease" for c in late)
    await run(*late)  # ... then the round trip, late
    assert await redis.zcard(keys.node_leases("n1")) == 0
    assert int(await redis.hget(keys.node_ledger("n1"), "kv") or 0) == 0
    await client.aclose()


def drop_connections(d: Dispatcher, n: int) -> list[int]:
    """Make the next `drops[0]` round trips of `d` fail as a pooled connection closed under
    them; returns `drops` (set it again to drop more)."""
    run, drops = d.store.scripts.run, [n]

    async def dropped(*calls: Call, **kw: Any) -> list[Any]:
        if drops[0]:
            drops[0] -= 1
            raise rex.ConnectionError("Connection closed by server.")
        return await run(*calls, **kw)

    d.store.scripts.run = dropped  # type: ignore[method-assign]
    return drops


async def test_one_dropped_connection_is_asked_again_not_an_outage(
    redis: Any, redis_server: RedisServer
) -> None:
    # A pooled connection closed under the round trip ("Connection closed by server"): asked
    # again at once, it is admitted with its lease, and the failure mode stays off. Two in a
    # row are Redis being away.
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    d, client = make(p)
    scripts = d.store.scripts
    run = scripts.run
    drops = drop_connections(d, 1)
    adm = await d.admit(p.tenants["t1"], "realtime", "m", 10, 50 - 10)
    assert not d.limiter.degraded and drops == [0]
    assert await redis.zrange(keys.node_leases("n1"), 0, -1) == [adm.ticket.encode()]
    drops[0] = 2
    t1 = p.tenants["t1"]
    debit = d.limiter.debit(t1, "r" * 16, 50, 60.0, 1.0, False)
    assert await d.limiter.round_trip([debit], t1, "r" * 16) is None  # two in a row: away
    assert d.limiter.degraded and drops == [0]
    scripts.run = run  # type: ignore[method-assign]
    await client.aclose()


async def test_a_release_on_a_dropped_connection_is_sent_again_not_an_outage(
    redis: Any, redis_server: RedisServer
) -> None:
    # The same for a batch of releases (settlements and lease give-backs): sent again at once,
    # they settle now, and the failure mode stays off (it was entered for half a second among
    # 8 sidecars on a loaded Redis Cluster: tests/test_many_sidecars.py). Two in a row are Redis
    # being away: owed to the backlog, which delivers them once Redis answers.
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    d, client = make(p)
    scripts = d.store.scripts
    run = scripts.run
    drops = drop_connections(d, 0)
    first = await d.admit(p.tenants["t1"], "realtime", "m", 10, 50 - 10)
    await d.ahead.settled([first.ticket])  # booked (when answered ahead of its booking)
    drops[0] = 1
    assert await d.release(first.ticket, 20) == 30  # settled now: its refund is known
    assert not d.limiter.degraded and drops == [0] and len(d.store.backlog) == 0
    assert await redis.zcard(keys.node_leases("n1")) == 0
    second = await d.admit(p.tenants["t1"], "realtime", "m", 10, 50 - 10)
    await d.ahead.settled([second.ticket])
    drops[0] = 2
    assert await d.release(second.ticket, 20) == 0  # owed: refunded later
    assert d.limiter.degraded and drops == [0] and len(d.store.backlog) == 1
    assert await redis.zcard(keys.node_leases("n1")) == 1
    assert await d.store.backlog.flush()
    assert await redis.zcard(keys.node_leases("n1")) == 0
    # And the lease of a request taken from the queue (the dispatcher's own round trip).
    item = Item("t1", "realtime", 50, "m", d.clock(), d.clock() + 5, rid="q" * 16, prompt=10)
    drops[0] = 1
    adm = await d.place.lease(item, d._eligible(item))
    assert adm is not None and drops == [0]
    assert await redis.zrange(keys.node_leases("n1"), 0, -1) == [adm.ticket.encode()]
    scripts.run = run  # type: ignore[method-assign]
    await client.aclose()


async def test_a_debit_that_ran_beside_a_full_pool_is_refunded_when_the_wait_gives_up(
    redis: Any, redis_server: RedisServer
) -> None:
    # On Redis Cluster a round trip's calls go out concurrently, one pool per master: the debit
    # can run while the lease's master has no free connection (PoolBusy). Waiting in line for
    # `busy_wait_s` and then answering 503 admission_busy, the request does not run: what the
    # debit reserved is refunded too (before, it stayed until its TTL, the tenant charged), as
    # the lease is given back.
    from admission.store import PoolBusy

    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    d, client = make(p)
    d.limiter.busy_wait_s = 0.05
    run = d.store.scripts.run

    async def half_busy(*calls: Call, **kw: Any) -> list[Any]:
        await run(*calls, **kw)  # every call ran, and one of them says "pool busy"
        raise PoolBusy("Too many connections")

    d.store.scripts.run = half_busy  # type: ignore[method-assign]
    with pytest.raises(BackendUnavailable) as ei:
        await d.admit(p.tenants["t1"], "realtime", "m", 10, 50 - 10, rid="b" * 16)
    assert ei.value.code == "admission_busy"
    d.store.scripts.run = run  # type: ignore[method-assign]
    assert await d.store.backlog.flush()
    assert not await redis.exists(keys.tenant_keys("t1", "b" * 16)[4])  # no reservation left
    assert await redis.zcard(keys.tenant_keys("t1", "b" * 16)[3]) == 0  # nor its slot
    assert await redis.zcard(keys.node_leases("n1")) == 0
    await client.aclose()


OCCUPANT = "o" * 16 + ":n1:t1"


async def full_node(redis_server: RedisServer) -> tuple[Policy, Dispatcher, Any]:
    """A dispatcher over one node of one in-flight slot, that slot taken in Redis by another
    request (`OCCUPANT`); this sidecar's view does not know it yet."""
    from admission.scheduling import leases

    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    p = dataclasses.replace(p, nodes={"n1": dataclasses.replace(p.nodes["n1"], max_inflight=1)})
    d, client = make(p)
    take = leases.take(p.nodes["n1"], OCCUPANT, 60, Ask(10, 50))
    assert leases.granted((await d.store.scripts.run(take))[0])
    return p, d, client


async def late_copy_books_nothing(d: Dispatcher, redis: Any, rid: str) -> None:
    """The occupant gone (room again), the backlog sent: a late first copy of `rid`'s lease on
    n1 runs at last and must book nothing (its ticket was given back for good)."""
    from admission.scheduling import leases

    await d.store.scripts.run(leases.give_back(OCCUPANT, released=True))
    assert await d.store.backlog.flush()
    node = d.policy().nodes["n1"]
    late = leases.take(node, make_ticket(rid, "n1", "t1"), 60, Ask(10, 50))
    (res,) = await d.store.scripts.run(late)
    assert leases.over(res) == "released"
    assert await redis.zcard(keys.node_leases("n1")) == 0


async def test_a_lease_refused_after_a_resend_is_given_back_for_good_when_the_request_ends(
    redis: Any, redis_server: RedisServer
) -> None:
    # The round trip carrying a fast-path lease was sent twice (a dropped connection, or a
    # timeout our late loop caused) and the second copy was refused; the request queued and
    # ended elsewhere (here: timed out). The first copy, still unread in a stalled Redis, may
    # run after that and book the lease, which no release would ever free (until its TTL: the
    # leases tests/test_many_sidecars.py left in CI under load). When the request ends, that
    # ticket is given back for good: the late copy books nothing.
    from admission.errors import QueueTimeout

    p, d, client = await full_node(redis_server)  # this sidecar's view: not yet full
    drops = drop_connections(d, 1)  # the first copy: "closed", and (say) still unread
    rid = "s" * 16
    with pytest.raises(QueueTimeout):  # refused (full), queued, and out of time
        await d.admit(p.tenants["t1"], "realtime", "m", 10, 40, waited_s=4.7, rid=rid)
    assert drops == [0]
    await late_copy_books_nothing(d, redis, rid)
    await client.aclose()


async def test_a_queued_lease_refused_after_a_resend_is_given_back_when_its_waiter_is_gone(
    redis: Any, redis_server: RedisServer
) -> None:
    # The same on the queue's path: the dispatcher's lease was sent twice and refused, and by
    # then the request had timed out in the queue (admit had ended): the dispatcher gives the
    # ticket back for good itself.
    from admission.errors import QueueTimeout

    p, d, client = await full_node(redis_server)
    rid = "q" * 16
    waiting = asyncio.ensure_future(
        d.admit(p.tenants["t1"], "realtime", "m", 10, 40, waited_s=4.6, rid=rid)
    )
    while not len(d.queue):  # noqa: ASYNC110 (its fast-path lease was refused: it waits)
        await asyncio.sleep(0.01)
    d.nodes.views["n1"].inflight = 0  # this sidecar's view: room again
    run, calls = d.store.scripts.run, [0]

    async def slow_then_dropped(*c: Call, **kw: Any) -> list[Any]:
        calls[0] += 1
        if calls[0] == 1:  # out past the request's deadline, then "closed", unread
            await asyncio.sleep(0.6)
            raise rex.ConnectionError("Connection closed by server.")
        return await run(*c, **kw)

    d.store.scripts.run = slow_then_dropped  # type: ignore[method-assign]
    assert await d.dispatch() == 0  # asked again: refused (n1 is full)
    d.store.scripts.run = run  # type: ignore[method-assign]
    with pytest.raises(QueueTimeout):
        await waiting
    assert calls[0] >= 2  # the lease twice (and the refund of the request that timed out)
    await late_copy_books_nothing(d, redis, rid)
    await client.aclose()


async def test_a_lease_release_that_fails_in_redis_is_logged(
    redis: Any, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # A script error in a lease's release (not Redis being away, which the backlog retries)
    # would leave the lease booked until its TTL: it is logged (tests/test_many_sidecars.py
    # fails on it), and the settlement beside it still counts.
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    d, client = make(p)
    adm = await d.admit(p.tenants["t1"], "realtime", "m", 10, 50 - 10)
    await d.ahead.settled([adm.ticket])
    await redis.delete(keys.node_leases("n1"))
    await redis.set(keys.node_leases("n1"), "not a sorted set")  # unlease.lua's ZREM fails
    with caplog.at_level(logging.ERROR):
        assert await d.release(adm.ticket, 20) == 30
    assert f"giving back lease {adm.ticket} failed" in caplog.text
    assert "WRONGTYPE" in caplog.text
    await client.aclose()


async def test_a_caller_gone_mid_round_trip_leaves_nothing_booked(
    redis: Any, redis_server: RedisServer
) -> None:
    # The client left (its admission cancelled) while the round trip carrying its buckets and
    # lease was out: the round trip runs anyway (it is shared with other callers), so what it
    # took is given back in the next one.
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    d, client = make(p)
    await redis.execute_command("CLIENT", "PAUSE", 150, "WRITE")  # slow, within the timeout
    task = asyncio.ensure_future(d.admit(p.tenants["t1"], "realtime", "m", 10, 50 - 10))
    await asyncio.sleep(0.05)  # its round trip is out
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.5)  # the pause ends, the round trip runs, then the compensation
    assert await redis.zcard(keys.node_leases("n1")) == 0
    assert await redis.zcard(keys.tenant_keys("t1", "x")[3]) == 0  # no concurrency slot held
    assert await redis.keys(b"adm:{t:t1}:res:*") == []  # no reservation left
    await client.aclose()


async def test_a_caller_cancelled_as_its_reply_came_leaves_nothing_booked(
    redis: Any, redis_server: RedisServer
) -> None:
    # The reply and the cancel in one loop turn: the round trip's future already holds its
    # result when the task is cancelled, so the caller wakes up cancelled with its lease and
    # debit taken. Before, nothing gave them back (a lease left until its TTL).
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    d, client = make(p)
    task: asyncio.Future[Any] | None = None
    loop = asyncio.get_running_loop()

    def cancel_once(_s: float) -> None:  # runs after the reply came, before the caller resumes
        if task is not None and not task.done():
            loop.call_soon(task.cancel)

    d.store.scripts.observe = cancel_once
    task = asyncio.ensure_future(d.admit(p.tenants["t1"], "realtime", "m", 10, 50 - 10))
    with pytest.raises(asyncio.CancelledError):
        await task
    d.store.scripts.observe = lambda _s: None
    await asyncio.sleep(0.2)  # the compensation's round trip
    assert await redis.zcard(keys.node_leases("n1")) == 0
    assert await redis.zcard(keys.tenant_keys("t1", "x")[3]) == 0  # no concurrency slot held
    assert await redis.keys(b"adm:{t:t1}:res:*") == []  # no reservation left
    await client.aclose()


@pytest.mark.parametrize("when", ["mid_round_trip", "as_its_reply_came"])
async def test_a_queued_lease_whose_caller_left_is_given_back(
    redis: Any, redis_server: RedisServer, when: str
) -> None:
    # The lease taken for a request leaving the queue (or admitted on the queue's fast path, in
    # the request's own task): cancelled while it is out, or as its reply comes, it goes back.
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    d, client = make(p)
    item = Item("t1", "realtime", 50, "m", d.clock(), d.clock() + 5, rid="r" * 16, prompt=10)
    nodes = d._fast_path(item)
    assert nodes
    task = asyncio.ensure_future(d.place.lease(item, nodes))
    if when == "mid_round_trip":
        await redis.execute_command("CLIENT", "PAUSE", 150, "WRITE")
        await asyncio.sleep(0.05)
        task.cancel()
    else:
        loop = asyncio.get_running_loop()
        d.store.scripts.observe = lambda _s: loop.call_soon(task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.5)  # the round trip ran, then the compensation
    assert await redis.zcard(keys.node_leases("n1")) == 0
    assert int(await redis.hget(keys.node_ledger("n1"), "kv") or 0) == 0
    await client.aclose()


@pytest.mark.parametrize(
    "error",
    [
        # As redis-py 8 parses them: its own classes, the prefix stripped from the message.
        rex.ReadOnlyError("You can't write against a read only replica."),
        rex.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        rex.TryAgainError("Multiple keys request during rehashing of slot"),
        rex.ClusterDownError("The cluster is down"),
        # Unparsed reply errors keep their prefix.
        rex.ResponseError("READONLY You can't write against a read only replica."),
        rex.ResponseError("BUSY Redis is busy running a script."),
    ],
    ids=lambda e: type(e).__name__ + ":" + str(e)[:8],
)
async def test_redis_refusing_writes_is_unavailable_not_a_crash(
    redis: Any, redis_server: RedisServer, error: Exception
) -> None:
    # A replica promoted / failover in progress (READONLY), maxmemory (OOM), a resharding
    # cluster: the same failure path as a dead connection (here fail-closed: 503), never an
    # unhandled ResponseError (which answered 500 until redis-py's classes were recognised).
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}", "closed")
    d, client = make(p)

    async def refuse(calls: tuple[Call, ...]) -> list[Any]:
        return [error] * len(calls)

    d.store.scripts._batch = refuse  # type: ignore[method-assign]
    with pytest.raises(BackendUnavailable):
        await d.admit(p.tenants["t1"], "realtime", "m", 10, 50 - 10)
    await client.aclose()


async def test_aging_moves_the_queue_not_the_engine_priority(
    redis: Any, redis_server: RedisServer
) -> None:
    # batch (priority 1) waits past promote_after_s (2 s) and is promoted to realtime in the
    # queue; the priority it carries into vLLM stays batch's.
    p = make_policy(redis_server.url)
    now = [100.0]
    client = connect(p.redis)
    st = Store.over(client, Metrics())
    d = Dispatcher(
        st, Limiter(st, lambda: p, Metrics()), lambda: p, Metrics(), clock=lambda: now[0]
    )
    view = d.nodes.views["n1"]
    view.state, view.inflight = Status.OPEN, view.node.max_inflight  # full: requests queue
    task = asyncio.create_task(d.admit(p.tenants["acme"], "batch", "m", 10, 100 - 10))
    for _ in range(20):
        await asyncio.sleep(0.01)
        if len(d.queue):
            break
    now[0] += 3.0
    assert d.queue.age(now[0]) == 1 and d.queue.depth("realtime") == 1
    view.inflight = 0
    assert await d.dispatch() == 1
    adm = await task
    assert adm.cls == "realtime"  # promoted in the queue ...
    assert adm.priority // BANDS == p.classes["batch"].priority == 1  # ... not inside the engine
    await client.aclose()


async def test_shadow_tenant_is_counted_not_refused(redis: Any, redis_server: RedisServer) -> None:
    # A burst of 1: the second request is over the limit. In shadow mode it is admitted, and
    # the metric says what the limit would have done.
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 0.01, request_burst: 1, tokens_per_min: 60000}"
    )
    t = dataclasses.replace(p.tenants["t1"], shadow=True)
    d, client = make(p)
    await d.admit(t, "realtime", "m", 10, 0)
    await d.admit(t, "realtime", "m", 10, 0)  # not refused
    m = d.metrics.shadow_decisions
    assert m.labels("t1", "admit")._value.get() == 1
    assert m.labels("t1", "requests_per_s")._value.get() == 1
    with pytest.raises(Throttled):  # the same tenant without shadow: refused
        await d.admit(p.tenants["t1"], "realtime", "m", 10, 0)
    await client.aclose()


async def test_memory_aware_limits_tighten_lower_classes_while_a_model_stays_held(
    redis: Any, redis_server: RedisServer
) -> None:
    """Every node of the model held for tighten_after_s: the refill of classes below the most
    urgent one slows by tighten_factor (realtime keeps its rate); a node that opens again
    relaxes it. Visible as admission_limit_factor{model}."""
    p = make_policy(
        redis_server.url,
        BASE_POLICY.replace(
            "stale_after_s: 2}", "stale_after_s: 2, tighten_after_s: 0.3, tighten_factor: 0.05}"
        ),
    )
    now = [100.0]
    client = connect(p.redis)
    st = Store.over(client, Metrics())
    metrics = Metrics()
    d = Dispatcher(st, Limiter(st, lambda: p, metrics), lambda: p, metrics, clock=lambda: now[0])
    nt = d.nodes
    view = nt.views["n1"]
    view.state = Status.HOLD
    nt._by_model(now[0])
    assert nt.pressure.limit_factor("m", "batch") == 1.0  # held, but not for long yet
    now[0] += 0.5
    nt._by_model(now[0])
    assert nt.pressure.limit_factor("m", "batch") == 0.05
    assert nt.pressure.limit_factor("m", "realtime") == 1.0
    nt.pressure.gauge()
    assert metrics.limit_factor.labels("m")._value.get() == 0.05
    assert nt.pressure.snapshot()[0]["factor"] == 0.05

    # acme: 10 req/s, burst 10. Empty the request bucket, then wait 0.3 s of real time:
    # realtime refills 3 requests; batch, at 0.05 × the rate, not one.
    tenant = p.tenants["acme"]
    lim = d.limiter
    for i in range(10):
        assert (await lim.acquire(tenant, f"r{i}", 1, 60)).denied is None
    await asyncio.sleep(0.3)
    with pytest.raises(Throttled) as ei:  # through admit: it applies the factor by class
        await d.admit(tenant, "batch", "m", 0, 1)
    assert ei.value.reason == "requests_per_s"
    real = await lim.acquire(tenant, "r10", 1, 60, scale=nt.pressure.limit_factor("m", "realtime"))
    assert real.denied is None

    view.state = Status.OPEN  # memory recovered
    nt._by_model(now[0])
    assert nt.pressure.limit_factor("m", "batch") == 1.0 and nt.pressure.snapshot() == []
    await client.aclose()


async def test_a_class_under_its_min_share_is_not_held_by_the_decode_guard(
    redis_server: RedisServer,
) -> None:
    """Realtime's decode is slow on the only node (the guard holds batch off it), but batch has
    been admitted less than its min_share (0.1) of the tokens over the last seconds while
    realtime is past capacity (refused late): the policy guarantees batch that much, so the
    guard lets it through — until it has had its share. Within realtime's capacity the guard
    holds as before. A class with no SLO (offline) is not owed by this rule: the queue gives it
    its min_share."""
    slo = "slo: {ttft_ms: 1000, e2e_ms: 10000, tpot_ms: 60}"
    text = BASE_POLICY.replace("deadline_s: 5}", f"deadline_s: 5, admit_until: drain, {slo}}}")
    text = text.replace("promote_after_s: 2}", "promote_after_s: 2, slo: {ttft_ms: 10000}}")
    p = make_policy(redis_server.url, text)
    now = [100.0]
    d, client = make(p, clock=lambda: now[0])  # n1 open
    v = d.nodes.views["n1"]
    v.per_token, v.prefill_rate = 0.0001, 1000.0
    v.ledger(0.0, 50, 1, now[0], urgent=50, reserve=50.0)  # realtime runs there
    d.nodes._urgent_nodes.add("n1")  # as the node refresh marks it
    v.tpot_s = 1.0  # its decode far slower than 60 ms a token

    def item(cls: str) -> Item:
        return Item(
            tenant="acme", cls=cls, cost=100, model="m", enqueued_at=now[0], deadline_at=now[0] + 10
        )

    shed = d.place.shed
    assert d._eligible(item("batch")) == []  # nothing admitted yet: no share to be short of
    for _ in range(20):  # realtime admitted, batch not: batch is owed its min_share
        shed.admitted("m", "realtime", 1000, now[0])
        now[0] += 0.05
    assert shed.class_share("m", "batch", now[0]) == 0.0
    assert d._eligible(item("batch")) == []  # realtime within capacity: its decode comes first
    d.overload.refused_late("m", "realtime", now[0])  # past capacity: refused late
    assert [n.node.id for n, _a in d._eligible(item("batch"))] == ["n1"]
    assert status._decode_guard(d)["under_min_share"] == ["batch"]  # /status.json says so
    assert d._eligible(item("offline")) == []  # no SLO: the guard holds it as before
    for _ in range(5):  # batch admitted past its min_share: the guard holds it again
        shed.admitted("m", "batch", 1000, now[0])
        now[0] += 0.05
    assert shed.class_share("m", "batch", now[0]) > 0.1
    assert d._eligible(item("batch")) == []
    now[0] += 60  # rates decay alike: the share is of what was admitted lately
    assert shed.class_share("m", "batch", now[0]) == pytest.approx(0.2, abs=0.05)
    await client.aclose()
