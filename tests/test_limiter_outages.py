"""Tenant limits when Redis is away, slow or busy: failure modes, the backlog of calls owed,
calls timed out that ran, pool exhaustion and a late event loop (the limiter of
tests/test_limiter.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis import exceptions as rex

from admission.errors import BackendUnavailable, Throttled
from admission.limits import Acquired, Limiter
from admission.loop_lag import WINDOW_S
from admission.metrics import Metrics
from admission.policy import Policy, Tenant
from admission.scheduling import round_trip
from admission.store import Call, Store, connect, keys
from devstack.procs import RedisServer
from tests.test_limiter import lease, make_limiter, take, tenant_policy


async def test_redis_restart_mid_run_and_failure_modes(tmp_path: Any) -> None:
    server = RedisServer(tmp_path / "r")
    server.start()
    try:
        for mode in ("open", "closed"):
            p = tenant_policy(
                server.url, "{requests_per_s: 2, request_burst: 4, tokens_per_min: 6000}", mode
            )
            lim, client = await make_limiter(p)
            t = p.tenants["t1"]
            assert (await take(lim, t, f"{mode}-a", 1, 60))[0] == "redis"
            server.stop()
            if mode == "open":
                # Local bucket at fail_open_fraction (0.5) of burst 4: exactly 2 admitted.
                assert (await take(lim, t, "o1", 1, 60))[0] == "local"
                assert lim.degraded
                assert (await take(lim, t, "o2", 1, 60))[0] == "local"
                with pytest.raises(Throttled):
                    await take(lim, t, "o3", 1, 60)
            else:
                with pytest.raises(BackendUnavailable) as ei:
                    await take(lim, t, "c1", 1, 60)
                assert ei.value.status == 503 and ei.value.code == "limiter_unavailable"
            server.start()
            lim._down_until = 0.0  # skip the 1 s back-off rather than sleep through it
            assert (await take(lim, t, f"{mode}-b", 1, 60))[0] == "redis"  # recovered by itself
            assert not lim.degraded
            await client.aclose()
    finally:
        server.stop()


async def test_redis_errors_are_counted(redis_server: RedisServer) -> None:
    p = tenant_policy(
        "redis://127.0.0.1:1/0", "{requests_per_s: 2, tokens_per_min: 6000}", "closed"
    )
    lim, client = await make_limiter(p)
    with pytest.raises(BackendUnavailable):
        await take(lim, p.tenants["t1"], "a", 1, 60)
    assert lim.metrics.redis_errors.labels("acquire")._value.get() == 1
    await client.aclose()


async def test_release_while_redis_is_away_is_replayed(
    redis: Any, redis_server: RedisServer
) -> None:
    # A release that cannot reach Redis must not leave the concurrency slot and the node lease
    # taken until their TTL (600 s): it waits in the backlog and runs once Redis answers.
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000, max_concurrent: 1}"
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    acq, leased = await round_trip.debit(lim, t, "a", 50, 600, lease=lease("n1", "a:n1:t1"))
    assert acq.mode == "redis" and acq.denied is None and int(leased[0]) == 1
    lim._down_until = lim.clock() + 60  # Redis just failed: degraded for a while
    release = Call(None, [], ["ZREM", keys.node_leases("n1"), "a:n1:t1"])
    assert await round_trip.settle(lim, [(t, "a", 20, False)], [release]) == [0]
    assert len(lim.backlog) == 1
    assert await redis.zcard(keys.node_leases("n1")) == 1  # not yet given back
    lim._down_until = 0.0
    assert await lim.backlog.flush()
    assert len(lim.backlog) == 0
    assert await redis.zcard(keys.node_leases("n1")) == 0
    assert await redis.zcard(keys.tenant_keys("t1", "a")[3]) == 0  # concurrency slot free
    assert not await redis.exists(keys.tenant_keys("t1", "a")[4])  # refunded (30 tokens)
    assert (await take(lim, t, "b", 1, 600))[0] == "redis"
    await client.aclose()


@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_timed_out_acquire_that_ran_is_given_back(
    redis: Any, redis_server: RedisServer, mode: str
) -> None:
    # Redis slow, not gone: the client times out, but the script ran. Its reservation must
    # come back, not leak for the TTL.
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000, max_concurrent: 1}", mode
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    run = lim.store.scripts.run

    async def ran_then_timed_out(*calls: Call, **_kw: Any) -> list[Any]:
        await run(*calls)
        raise rex.TimeoutError("Timeout reading from socket")

    lim.store.scripts.run = ran_then_timed_out  # type: ignore[method-assign]
    acq, got = await round_trip.debit(lim, t, "a", 50, 600, lease=lease("n1", "a:n1:t1"))
    assert acq.mode == "local"
    assert got is None  # "may have run": the caller (the dispatcher) decides about it
    if mode == "open":
        assert acq.denied is None
    else:
        assert isinstance(acq.denied, BackendUnavailable)
    lim.store.scripts.run = run  # type: ignore[method-assign]
    assert await redis.zcard(keys.tenant_keys("t1", "a")[3]) == 1  # it did run
    lim._down_until = 0.0
    assert await lim.backlog.flush()
    assert await redis.zcard(keys.tenant_keys("t1", "a")[3]) == 0
    assert not await redis.exists(keys.tenant_keys("t1", "a")[4])
    # The limiter undoes only its own work: the lease that rode along is the caller's.
    assert await redis.zcard(keys.node_leases("n1")) == 1
    assert lim.metrics.redis_backlog._value.get() == 0
    await client.aclose()


async def test_backlog_keeps_calls_while_redis_is_down(tmp_path: Any) -> None:
    server = RedisServer(tmp_path / "r")
    server.start()
    try:
        p = tenant_policy(server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
        lim, client = await make_limiter(p)
        t = p.tenants["t1"]
        await take(lim, t, "a", 5, 600)
        server.stop()
        assert await lim.settle(t, "a", 1) == 0  # fails: kept
        assert len(lim.backlog) == 1
        assert not await lim.backlog.flush()  # still down: kept, in order
        assert len(lim.backlog) == 1
        server.start()
        lim._down_until = 0.0
        assert await lim.backlog.flush()
        assert len(lim.backlog) == 0
        await client.aclose()
    finally:
        server.stop()


def test_tenant_is_frozen(policy: Policy) -> None:
    t: Tenant = policy.tenants["acme"]
    with pytest.raises(AttributeError):
        t.weight = 2  # type: ignore[misc]
    assert isinstance(rex.ConnectionError("x"), Exception)


async def test_pool_exhaustion_is_busy_not_an_outage(redis_server: RedisServer) -> None:
    """Every pooled connection in use is this process's overload: the admission waits in line
    for a connection; past `busy_wait_s`, 503 admission_busy, and the sidecar stays on Redis
    (no flip to fail-open that would skip every shared limit)."""
    p = tenant_policy(
        redis_server.url,
        "{requests_per_s: 100, tokens_per_min: 600000}",
        redis_extra=", pool_size: 1, pool_wait_ms: 50",
    )
    lim, client = await make_limiter(p)
    held = await client.connection_pool.get_connection()
    # A short overload: the admission waits in line for the connection, then goes through.
    lim.busy_wait_s = 3.0
    release = asyncio.get_running_loop().call_later(
        0.3, lambda: asyncio.ensure_future(client.connection_pool.release(held))
    )
    assert (await take(lim, p.tenants["t1"], "busy-0", 1, 60)).mode == "redis"
    release.cancel()
    held = await client.connection_pool.get_connection()
    lim.busy_wait_s = 0.3  # a long one: refused after the wait, still on Redis
    try:
        acq = await lim.acquire(p.tenants["t1"], "busy-1", 1, 60)
        assert isinstance(acq.denied, BackendUnavailable)
        assert acq.denied.code == "admission_busy" and acq.denied.retry_after_s() == 1
        assert not lim.degraded
        assert lim.metrics.redis_fallback._value.get() == 0
    finally:
        await client.connection_pool.release(held)
    assert (await take(lim, p.tenants["t1"], "busy-2", 1, 60)).mode == "redis"
    await client.aclose()


async def test_fail_open_keeps_concurrency_burst_and_bucket_levels(tmp_path: Any) -> None:
    """Local limits apply max_concurrent and burst_max (at fail_open_fraction), free a slot at
    settle, and a second outage starts from the levels the first left, not from full."""
    server = RedisServer(tmp_path / "r")
    server.start()
    p = tenant_policy(
        server.url,
        "{requests_per_s: 0.01, request_burst: 8, tokens_per_min: 6000, max_concurrent: 4,"
        " burst_max: 6, burst_window_s: 30}",
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    server.stop()
    try:
        # fraction 0.5: 2 concurrent, 3 per burst window, 4 in the request bucket.
        assert (await take(lim, t, "a", 1, 60)).mode == "local"
        await take(lim, t, "b", 1, 60)
        with pytest.raises(Throttled) as ei:
            await take(lim, t, "c", 1, 60)
        assert ei.value.reason == "concurrency"
        await lim.settle(t, "a", 1)  # frees a's slot (the Redis part goes to the backlog)
        await take(lim, t, "c", 1, 60)
        await lim.settle(t, "b", 1)
        with pytest.raises(Throttled) as ei:
            await take(lim, t, "d", 1, 60)
        assert ei.value.reason == "burst"  # 3 in the 30 s window
        # Redis back, then away again: the request bucket keeps its level (1 of 4 left).
        server.start()
        lim._down_until = 0.0
        await lim.settle(t, "c", 1)
        assert (await take(lim, t, "r1", 1, 60)).mode == "redis"
        server.stop()
        lim._down_until = 0.0
        lim._local._recent.clear()  # the burst window is not what this part checks
        await lim.settle(t, "r1", 1)
        assert (await take(lim, t, "e", 1, 60)).mode == "local"
        with pytest.raises(Throttled) as ei:
            await take(lim, t, "f", 1, 60)
        assert ei.value.reason == "requests_per_s"
    finally:
        await client.aclose()
        server.stop()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(
            st.one_of(
                st.text(min_size=0, max_size=12),
                st.binary(max_size=12),
                st.integers(-(2**62), 2**62),
                st.floats(allow_nan=False, allow_infinity=False),
            ),
            min_size=1,
            max_size=12,
        ),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from(["EVALSHA", "SCRIPT LOAD", b"HSET", b"CONFIG GET"]),
)
def test_hiredis_packing_matches_redis_py(args: list[list[Any]], name: Any) -> None:
    """The sidecar's connections pack commands with hiredis (C) instead of redis-py's Python
    packer: the bytes on the wire are the same for every argument type we send."""
    from redis.asyncio.connection import Connection

    mine = connect(
        tenant_policy("redis://127.0.0.1:1", "{requests_per_s: 1, tokens_per_min: 60}").redis
    )
    conn = mine.connection_pool.make_connection()
    assert type(conn).__name__ == "HiredisConnection"
    plain = Connection()
    cmds = [(name, *a) for a in args]
    assert b"".join(conn.pack_commands(cmds)) == b"".join(plain.pack_commands(cmds))
    assert b"".join(conn.pack_command(*cmds[0])) == b"".join(plain.pack_command(*cmds[0]))


def test_hiredis_packing_refuses_what_redis_py_refuses() -> None:
    conn = connect(
        tenant_policy("redis://127.0.0.1:1", "{requests_per_s: 1, tokens_per_min: 60}").redis
    ).connection_pool.make_connection()
    with pytest.raises(rex.DataError):
        conn.pack_command("SET", "k", None)


async def test_round_trips_are_timed(redis_server: RedisServer) -> None:
    """Every coalesced round trip that answered is observed once, in seconds."""
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 600000}")
    m = Metrics()
    store = Store.open(p.redis, m)
    lim = Limiter(store, lambda: p, m)
    await asyncio.gather(*(take(lim, p.tenants["t1"], f"rt-{i}", 1, 60) for i in range(20)))
    count = m.registry.get_sample_value("admission_redis_round_trip_seconds_count")
    total = m.registry.get_sample_value("admission_redis_round_trip_seconds_sum")
    assert count is not None and 1 <= count <= 20  # 20 calls, coalesced into fewer trips
    assert total is not None and 0 < total < 5
    await store.close()


async def test_a_late_event_loop_is_overload_not_an_outage(redis_server: RedisServer) -> None:
    """A Redis call that timed out while this process's event loop ran late is the sidecar's
    own overload: asked again in line (acquire.lua is idempotent per request) and answered once
    Redis does, charged once; past the wait, refused 503 `sidecar_overloaded`. The limiter stays
    on Redis throughout (fail-open would skip every tenant's limits). The same timeout with a
    punctual loop is an outage: the failure mode applies. Redis is made slow for real (CLIENT
    PAUSE), the loop late for real (a blocking call in it)."""
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 600000}")
    lim, client = await make_limiter(p)
    admin = connect(p.redis)
    probe = asyncio.create_task(lim.lag.run())
    t = p.tenants["t1"]

    async def late_call(ticket: str) -> Acquired:
        await admin.execute_command("CLIENT", "PAUSE", 600, "ALL")
        task = asyncio.create_task(lim.acquire(t, ticket, 10, 60))
        await asyncio.sleep(0.02)  # sent; now the loop is blocked past the call's timeout
        time.sleep(0.3)
        return await task

    try:
        await asyncio.sleep(0.1)
        assert not lim.lag.overloaded()
        acq = await late_call("late-1")  # waits in line: answered when Redis is back
        assert acq.mode == "redis" and acq.denied is None
        assert not lim.degraded and lim.metrics.redis_fallback._value.get() == 0
        assert lim.metrics.overloaded.labels("acquire")._value.get() >= 1
        charged = await client.hget(keys.tenant_keys("t1", "late-1")[4], "tok")
        assert charged is not None and int(charged) == 10  # reserved once, not given back

        await asyncio.sleep(WINDOW_S * 2.2)
        lim.busy_wait_s = 0.1  # a wait in line shorter than the pause: refused, still no fail-open
        acq = await late_call("late-2")
        assert isinstance(acq.denied, BackendUnavailable)
        assert acq.denied.code == "sidecar_overloaded" and acq.denied.retry_after_s() == 1
        assert not lim.degraded and lim.metrics.redis_fallback._value.get() == 0
        await asyncio.sleep(0.7)  # Redis back
        assert (await take(lim, t, "late-3", 1, 60)).mode == "redis"

        await asyncio.sleep(WINDOW_S * 2.2)  # the loop punctual again
        assert not lim.lag.overloaded()
        await admin.execute_command("CLIENT", "PAUSE", 600, "ALL")
        acq = await lim.acquire(t, "outage-1", 1, 60)
        assert acq.mode == "local" and acq.denied is None  # failure_mode: open
        assert lim.degraded
    finally:
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
        await asyncio.sleep(0.7)
        await admin.aclose()
        await client.aclose()
