"""The dispatcher owns the admit decision: what it takes and does not use, it gives back."""

from __future__ import annotations

from typing import Any

import pytest
from redis import exceptions as rex

from admission.errors import BackendUnavailable, Throttled
from admission.limits import Limiter
from admission.metrics import Metrics
from admission.nodes.state import Status
from admission.policy import Policy
from admission.scheduling import Dispatcher
from admission.store import Call, Store, connect, keys
from devstack.procs import RedisServer
from tests.test_limiter import tenant_policy


def make(p: Policy) -> tuple[Dispatcher, Any]:
    client = connect(p.redis)
    st = Store.over(client, Metrics())
    d = Dispatcher(st, Limiter(st, lambda: p, st.backlog.metrics), lambda: p, Metrics())
    v = d.nodes.views["n1"]
    v.state = Status.OPEN  # as if its agent had published: the fast path applies
    return d, client


async def test_fast_path_lease_rides_with_the_buckets_and_release_frees_both(
    redis: Any, redis_server: RedisServer
) -> None:
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}")
    d, client = make(p)
    adm = await d.admit(p.tenants["t1"], "realtime", "m", 100)
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
    await d.admit(p.tenants["t1"], "realtime", "m", 10)
    with pytest.raises(Throttled):
        await d.admit(p.tenants["t1"], "realtime", "m", 10)
    assert await redis.zcard(keys.node_leases("n1")) == 1  # only the admitted one
    await client.aclose()


async def test_fail_closed_round_trip_that_ran_leaves_no_lease(
    redis: Any, redis_server: RedisServer
) -> None:
    # Redis slow, not gone: the pipeline carrying buckets + lease ran, but the client timed out.
    # Fail-closed refuses the request, so the lease it may hold must be given back.
    p = tenant_policy(
        redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000, max_concurrent: 1}",
        "closed",
    )  # fmt: skip
    d, client = make(p)
    scripts = d.store.scripts
    run = scripts.run

    async def ran_then_timed_out(*calls: Call) -> list[Any]:
        await run(*calls)
        raise rex.TimeoutError("Timeout reading from socket")

    scripts.run = ran_then_timed_out  # type: ignore[method-assign]
    with pytest.raises(BackendUnavailable):
        await d.admit(p.tenants["t1"], "realtime", "m", 50)
    scripts.run = run  # type: ignore[method-assign]
    assert await redis.zcard(keys.node_leases("n1")) == 1  # it did run
    assert await d.store.backlog.flush()
    assert await redis.zcard(keys.node_leases("n1")) == 0
    assert await redis.zcard(keys.tenant_keys("t1", "a")[3]) == 0  # concurrency slot back
    await client.aclose()


async def test_readonly_redis_is_unavailable_not_a_crash(
    redis: Any, redis_server: RedisServer
) -> None:
    # A replica promoted / failover in progress answers READONLY: the same failure path as a
    # dead connection (here fail-closed: 503), never an unhandled ResponseError.
    p = tenant_policy(redis_server.url, "{requests_per_s: 100, tokens_per_min: 60000}", "closed")
    d, client = make(p)

    d.store.scripts._batch = lambda calls: _readonly(calls)  # type: ignore[method-assign]
    with pytest.raises(BackendUnavailable):
        await d.admit(p.tenants["t1"], "realtime", "m", 50)
    await client.aclose()


async def _readonly(calls: tuple[Call, ...]) -> list[Any]:
    return [rex.ResponseError("READONLY You can't write against a read only replica.")] * len(calls)
