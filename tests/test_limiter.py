"""The token-bucket scripts against a real redis-server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis import exceptions as rex

from admission.errors import BackendUnavailable, RequestTooLarge, Throttled
from admission.lag import WINDOW_S
from admission.limits import Acquired, Limiter
from admission.metrics import Metrics
from admission.policy import Policy, Tenant
from admission.scheduling import trip
from admission.store import Call, Store, connect, keys
from devstack.procs import RedisServer
from tests.conftest import ROOT, make_policy

U = 1_000_000


def tenant_policy(
    url: str, limits: str, failure_mode: str = "open", redis_extra: str = ""
) -> Policy:
    return make_policy(
        url,
        f"""
redis: {{url: "{url}", failure_mode: {failure_mode}, command_timeout_ms: 200,
         connect_timeout_ms: 200{redis_extra}}}
classes: {{realtime: {{weight: 1, priority: 0, deadline_s: 5}}}}
tenants:
  t1: {{keys: ["plain:k1"], limits: {limits}}}
nodes: {{n1: {{url: "http://127.0.0.1:1", models: [m]}}}}
""",
    )


async def make_limiter(p: Policy) -> tuple[Limiter, Any]:
    client = connect(p.redis)
    return Limiter(Store.over(client, Metrics()), lambda: p, Metrics()), client


async def take(lim: Limiter, *args: Any, **kw: Any) -> Acquired:
    """acquire, raising the denial (the dispatcher's way of using it)."""
    acq = await lim.acquire(*args, **kw)
    if acq.denied is not None:
        raise acq.denied
    return acq


async def rewind(redis: Any, tenant: str, which: int, us: int) -> None:
    """Move a bucket's last-refill time back by `us`: an exact, sleep-free clock injection."""
    key = keys.tenant_keys(tenant, "x")[which]
    t = int(await redis.hget(key, "t"))
    await redis.hset(key, "t", t - us)


async def test_burst_then_deny_with_retry_after(redis: Any, redis_server: RedisServer) -> None:
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 2, request_burst: 3, tokens_per_min: 6000}"
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    for i in range(3):
        assert (await take(lim, t, f"r{i}", 10, 60))[0] == "redis"
    with pytest.raises(Throttled) as ei:
        await take(lim, t, "r3", 10, 60)
    assert ei.value.reason == "requests_per_s"
    assert 0.45 <= ei.value.retry_after <= 0.5  # one request at 2/s: 500 ms minus elapsed
    assert ei.value.retry_after_s() == 1
    await client.aclose()


async def test_fractional_refill_is_exact(redis: Any, redis_server: RedisServer) -> None:
    # 100 tokens/min = 1.666.../s; rewinding the clock 30 s refills exactly 50 tokens.
    p = tenant_policy(
        redis_server.url,
        "{requests_per_s: 1000, request_burst: 1000, tokens_per_min: 100, token_burst: 100}",
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    await take(lim, t, "a", 100, 60)
    level = int(await redis.hget(keys.tenant_keys("t1", "x")[1], "l"))
    assert level == 0
    await rewind(redis, "t1", 1, 30 * U)
    with pytest.raises(Throttled) as ei:
        await take(lim, t, "b", 51, 60)
    assert ei.value.reason == "tokens_per_min"
    assert ei.value.retry_after == pytest.approx(0.6, abs=0.01)  # 1 token at 1.667/s
    assert (await take(lim, t, "c", 50, 60))[0] == "redis"
    level = int(await redis.hget(keys.tenant_keys("t1", "x")[1], "l"))
    assert 0 <= level < 0.05 * U  # only the ms between calls refilled (30 ms: a busy machine)
    await client.aclose()


async def test_half_request_per_second(redis: Any, redis_server: RedisServer) -> None:
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 0.5, request_burst: 1, tokens_per_min: 6000}"
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    await take(lim, t, "a", 1, 60)
    await rewind(redis, "t1", 0, 1_500_000)  # 0.75 of a request refilled
    with pytest.raises(Throttled) as ei:
        await take(lim, t, "b", 1, 60)
    assert ei.value.retry_after == pytest.approx(0.5, abs=0.01)
    await rewind(redis, "t1", 0, 500_000)
    assert (await take(lim, t, "c", 1, 60))[0] == "redis"
    await client.aclose()


async def test_cost_above_capacity_is_not_a_retry(redis: Any, redis_server: RedisServer) -> None:
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 5, tokens_per_min: 600, token_burst: 500}"
    )
    lim, client = await make_limiter(p)
    with pytest.raises(RequestTooLarge) as ei:
        await take(lim, p.tenants["t1"], "a", 501, 60)
    assert ei.value.capacity == 500 and ei.value.retry_after_s() is None
    assert await redis.keys("adm:*") == []  # nothing written
    await client.aclose()


async def test_denial_writes_nothing_across_buckets(redis: Any, redis_server: RedisServer) -> None:
    p = tenant_policy(
        redis_server.url,
        "{requests_per_s: 5, request_burst: 5, tokens_per_min: 600, token_burst: 100}",
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    await take(lim, t, "a", 90, 60)
    before = await redis.hgetall(keys.tenant_keys("t1", "x")[0])
    with pytest.raises(Throttled) as ei:
        await take(lim, t, "b", 20, 60)  # requests would pass, tokens do not
    assert ei.value.reason == "tokens_per_min"
    assert await redis.hgetall(keys.tenant_keys("t1", "x")[0]) == before
    assert not await redis.exists(keys.tenant_keys("t1", "b")[4])
    await client.aclose()


async def test_settle_refunds_once_and_charges_overage(
    redis: Any, redis_server: RedisServer
) -> None:
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 50, tokens_per_min: 60, token_burst: 1000}"
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    await take(lim, t, "a", 600, 60)
    assert await lim.settle(t, "a", 100) == 500
    assert await lim.settle(t, "a", 100) == 0  # idempotent per ticket
    level = int(await redis.hget(keys.tenant_keys("t1", "x")[1], "l"))
    assert 900 * U <= level < 901 * U
    await take(lim, t, "b", 100, 60)
    assert await lim.settle(t, "b", 300) == -200  # overage debited
    level = int(await redis.hget(keys.tenant_keys("t1", "x")[1], "l"))
    assert 600 * U <= level < 601 * U
    assert await lim.settle(t, "never-acquired", 0) == 0  # harmless
    await take(lim, t, "c", 50, 60)
    assert await lim.settle(t, "c", -1) == 0  # usage unknown: keep the charge
    await client.aclose()


async def test_overage_beyond_one_bucket_is_owed_in_full(
    redis: Any, redis_server: RedisServer
) -> None:
    # A request that used 5 buckets' worth must pay 5 buckets, not one: the debt is not capped.
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 50, tokens_per_min: 60, token_burst: 100}"
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    await take(lim, t, "a", 100, 60)
    assert await lim.settle(t, "a", 600) == -500
    level = int(await redis.hget(keys.tenant_keys("t1", "x")[1], "l"))
    assert -500 * U <= level < -499 * U  # (refilled a few µs since)
    with pytest.raises(Throttled) as ei:
        await take(lim, t, "b", 1, 60)
    assert ei.value.retry_after > 500  # 1 token/s refill: ~501 s until one token is back
    await client.aclose()


async def test_settle_after_reservation_expired_is_harmless(
    redis: Any, redis_server: RedisServer
) -> None:
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 50, tokens_per_min: 60, token_burst: 1000}"
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    await take(lim, t, "a", 600, 0.05)
    await redis.delete(keys.tenant_keys("t1", "a")[4])  # what expiry does
    assert await lim.settle(t, "a", 0) == 0
    await client.aclose()


async def test_key_ttl_is_time_to_full(redis: Any, redis_server: RedisServer) -> None:
    p = tenant_policy(
        redis_server.url,
        "{requests_per_s: 10, request_burst: 10, tokens_per_min: 6000, token_burst: 1000}",
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    await take(lim, t, "a", 500, 60)
    k = keys.tenant_keys("t1", "x")
    assert 90 <= await redis.pttl(k[0]) <= 100  # 1 request at 10/s
    assert 4900 <= await redis.pttl(k[1]) <= 5000  # 500 tokens at 100/s
    await client.aclose()


async def test_burst_guard_sliding_window(redis: Any, redis_server: RedisServer) -> None:
    p = tenant_policy(
        redis_server.url,
        "{requests_per_s: 1000, request_burst: 1000, tokens_per_min: 600000, burst_max: 3, burst_window_s: 10}",
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    for i in range(3):
        await take(lim, t, f"r{i}", 1, 60)
    with pytest.raises(Throttled) as ei:
        await take(lim, t, "r3", 1, 60)
    assert ei.value.reason == "burst" and 9.5 < ei.value.retry_after <= 10
    await client.aclose()


async def test_concurrency_limit_and_release(redis: Any, redis_server: RedisServer) -> None:
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000, max_concurrent: 2}"
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    await take(lim, t, "a", 1, 60)
    await take(lim, t, "b", 1, 60)
    with pytest.raises(Throttled) as ei:
        await take(lim, t, "c", 1, 60)
    assert ei.value.reason == "concurrency"
    await lim.settle(t, "a", 1)
    assert (await take(lim, t, "c", 1, 60))[0] == "redis"
    await client.aclose()


async def test_the_same_request_asked_twice_is_charged_once(
    redis: Any, redis_server: RedisServer
) -> None:
    """A request re-asked at another sidecar (its first died while it waited) comes with the
    same request id: one charge, one concurrency slot, and its one release frees both."""
    p = tenant_policy(
        redis_server.url,
        "{requests_per_s: 100, tokens_per_min: 6000, token_burst: 100, max_concurrent: 2}",
    )
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    await take(lim, t, "same", 60, 60)
    await take(lim, t, "same", 60, 60)  # 120 > 100 tokens if it were charged twice
    cc = keys.tenant_keys("t1", "same")[3]
    assert await redis.zcard(cc) == 1
    await take(lim, t, "other", 30, 60)  # the second slot is still free
    await lim.settle(t, "same", 60)
    await lim.settle(t, "other", 30)
    assert await redis.zcard(cc) == 0
    assert not await redis.exists(keys.tenant_keys("t1", "same")[4])
    await client.aclose()


async def test_lowering_capacity_clamps_level(redis: Any, redis_server: RedisServer) -> None:
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 1, request_burst: 10, tokens_per_min: 6000}"
    )
    lim, client = await make_limiter(p)
    await take(lim, p.tenants["t1"], "a", 1, 60)  # level 9 of 10
    p2 = tenant_policy(
        redis_server.url, "{requests_per_s: 0.001, request_burst: 2, tokens_per_min: 6000}"
    )
    lim2 = Limiter(Store.over(client, Metrics()), lambda: p2, Metrics())
    await take(lim2, p2.tenants["t1"], "b", 1, 60)
    await take(lim2, p2.tenants["t1"], "c", 1, 60)
    with pytest.raises(Throttled):
        await take(lim2, p2.tenants["t1"], "d", 1, 60)
    await client.aclose()


async def test_noscript_after_script_flush(redis: Any, redis_server: RedisServer) -> None:
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    lim, client = await make_limiter(p)
    t = p.tenants["t1"]
    await take(lim, t, "a", 1, 60)
    await redis.script_flush()
    assert (await take(lim, t, "b", 1, 60))[0] == "redis"  # reloaded on NOSCRIPT
    await lim.settle(t, "b", 0)
    await client.aclose()


async def test_noscript_retry_runs_only_the_calls_that_failed(
    redis: Any, redis_server: RedisServer
) -> None:
    # After SCRIPT FLUSH another sidecar reloaded `acquire` but not `lease`: in our pipeline
    # the acquire runs and the lease fails with NOSCRIPT. The retry must not debit twice.
    # Refilled slowly: at 100 requests/s the bucket was full again — no key — 10 ms after the
    # debit, and a loaded machine read None (seen in a full run, and on the commit before).
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 0.1, request_burst: 5, tokens_per_min: 60000}"
    )
    lim, client = await make_limiter(p)
    await redis.script_flush()
    await redis.script_load(lim.store.scripts.source["acquire"])
    acq, leased = await trip.debit(lim, p.tenants["t1"], "a", 1, 60, lease=lease("n1", "a:n1:t1"))
    assert acq.mode == "redis" and acq.denied is None and int(leased[0]) == 1
    level = int(await redis.hget(keys.tenant_keys("t1", "x")[0], "l"))
    assert level == 4 * U  # one request of the burst of 5, not two
    await client.aclose()


def _worker_code(url: str, n: int) -> str:
    return textwrap.dedent(f"""
        import asyncio, os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from admission.errors import Throttled
        from admission.limits import Limiter
        from admission.metrics import Metrics
        from admission.store import Store, connect
        from tests.test_limiter import take, tenant_policy

        async def main():
            p = tenant_policy({url!r}, "{{requests_per_s: 0.001, request_burst: 30, tokens_per_min: 6000}}")
            client = connect(p.redis)
            lim = Limiter(Store.over(client, Metrics()), lambda: p, Metrics())
            async def one(i):
                try:
                    await take(lim, p.tenants["t1"], f"{{i}}-{{os.getpid()}}", 1, 60)
                    return 1
                except Throttled:
                    return 0
            sys.stdin.readline()  # start together
            print(sum(await asyncio.gather(*(one(i) for i in range({n})))))
            await client.aclose()
        asyncio.run(main())
    """)


async def test_exact_burst_from_two_processes(redis: Any, redis_server: RedisServer) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _worker_code(redis_server.url, 40)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate("go\n", timeout=60)[0] for p in procs]
    assert sum(int(o.strip()) for o in outs) == 30  # 80 concurrent attempts, capacity 30


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


def lease(node: str, ticket: str) -> Call:
    return Call(
        "lease",
        [keys.node_leases(node), keys.node_ledger(node)],
        [8, 600 * U, ticket, 10, 50, 0, 0, -1],
    )


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
    acq, leased = await trip.debit(lim, t, "a", 50, 600, lease=lease("n1", "a:n1:t1"))
    assert acq.mode == "redis" and acq.denied is None and int(leased[0]) == 1
    lim._down_until = lim.clock() + 60  # Redis just failed: degraded for a while
    release = Call(None, [], ["ZREM", keys.node_leases("n1"), "a:n1:t1"])
    assert await trip.settle(lim, [(t, "a", 20, False)], [release]) == [0]
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
    acq, got = await trip.debit(lim, t, "a", 50, 600, lease=lease("n1", "a:n1:t1"))
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
