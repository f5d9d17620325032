"""The token-bucket scripts against a real redis-server."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

from admission.errors import RequestTooLarge, Throttled
from admission.limits import Acquired, Limiter
from admission.metrics import Metrics
from admission.policy import Policy
from admission.scheduling import round_trip
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
    acq, leased = await round_trip.debit(
        lim, p.tenants["t1"], "a", 1, 60, lease=lease("n1", "a:n1:t1")
    )
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


def lease(node: str, ticket: str) -> Call:
    return Call(
        "lease",
        [keys.node_leases(node), keys.node_ledger(node)],
        [8, 600 * U, ticket, 10, 50, 0, 0, -1],
    )
