"""`on_late: refuse` through the sidecar's HTTP API, against a real redis-server: a queued request
that can no longer meet its class's TTFT target is answered 429 `slo_unreachable` with
Retry-After at once (its tokens refunded), one that still can waits and runs, and the status page
counts the early refusals per class. The shipped policy sets it for realtime (which also gates
realtime by its own prefill budget) and batch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from admission.metrics import Metrics
from admission.policy import Node, OnLate, load_policy
from admission.reload import PolicyHolder
from admission.scheduling.ask import Request
from admission.scheduling.gates import ask_for
from admission.scheduling.views import NodeView
from admission.server import DISPATCHER, build_app
from admission.store import keys
from devstack.procs import RedisServer
from devstack.stack import DEFAULT_POLICY
from tests.conftest import BASE_POLICY, make_policy
from tests.test_server import admit_body, set_node

pytestmark = pytest.mark.timeout(60)

# Realtime: a 1 s first-token target, refused once waiting cannot meet it.
LATE_POLICY = BASE_POLICY.replace(
    "realtime: {weight: 8, min_share: 0.1, priority: 0, deadline_s: 5}",
    "realtime: {weight: 8, min_share: 0.1, priority: 0, deadline_s: 5,"
    " slo: {ttft_ms: 1000}, on_late: refuse}",
)


@pytest.fixture
async def sidecar(
    redis: Any, redis_server: RedisServer, tmp_path: Path
) -> AsyncIterator[TestClient[Any, Any]]:
    assert LATE_POLICY != BASE_POLICY
    client = await started(LATE_POLICY, redis, redis_server, tmp_path)
    yield client
    await client.close()


async def started(
    text: str, redis: Any, redis_server: RedisServer, tmp_path: Path
) -> TestClient[Any, Any]:
    """A sidecar on policy `text` over one node, n1, published at 10,000 prefill tokens/s."""
    path = tmp_path / "policies.yaml"
    path.write_text(text.replace("REDIS_URL", redis_server.url))
    holder = PolicyHolder(path, load_policy(path), Metrics())
    await set_node(redis, "n1", prefill_rate=10_000.0)
    client = TestClient(TestServer(build_app(holder, edge_table=tmp_path / "edge.json")))
    await client.start_server()
    return client


async def test_a_request_that_can_no_longer_be_in_time_is_refused_early(
    sidecar: Any, redis: Any
) -> None:
    client = sidecar
    # n1 takes 4 in flight: the fifth waits in the queue, for a slot that does not free.
    leases = [await client.post("/admit", json=admit_body()) for _ in range(4)]
    assert [r.status for r in leases] == [200] * 4
    started = asyncio.get_running_loop().time()
    r = await client.post("/admit", json=admit_body(max_tokens=1000))
    waited = asyncio.get_running_loop().time() - started
    assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
    assert (await r.json())["error"]["code"] == "slo_unreachable"
    # Refused once waiting + the soonest prefill passes the target less its margin (0.9 s for
    # the class the engine runs first),
    # well before the class's 5 s queue deadline.
    assert 0.5 <= waited < 2.5, waited
    level = int(await redis.hget(keys.tenant_keys("acme", "x")[1], "l") or 0)
    assert level == 0 or level >= 5000 * 10**6 - 4 * 10**8  # the 1,010 tokens refunded

    data = await (await client.get("/status.json")).json()
    rows = {c["class"]: c for c in data["queue"]["classes"]}
    assert rows["realtime"]["on_late"] == "refuse" and rows["realtime"]["late_refused_60s"] == 1
    assert rows["batch"]["on_late"] == "serve" and rows["batch"]["late_refused_60s"] == 0
    assert any(g["reason"] == "slo_unreachable" for g in data["refusals"])

    # A slot frees in time: the next request waits for it and runs.
    waiter = asyncio.ensure_future(client.post("/admit", json=admit_body()))
    await asyncio.sleep(0.2)
    ticket = (await leases[0].json())["ticket"]
    assert (await client.post("/release", json={"ticket": ticket})).status == 200
    assert (await asyncio.wait_for(waiter, 5)).status == 200


async def test_a_prompt_too_long_for_the_target_at_the_measured_rate_waits_its_turn(
    sidecar: Any, redis: Any
) -> None:
    """Its own prefill alone passes the target at the node's measured rate (950 tokens at
    1,000/s against 0.9 s): not refused on arrival, as a rate measured from short prompts
    only would have it — it waits for a slot, past the point a short one is refused, and runs."""
    client = sidecar
    await set_node(redis, "n1", prefill_rate=1_000.0)
    await asyncio.sleep(0.3)  # the sidecar's node refresh sees the new rate
    leases = [await client.post("/admit", json=admit_body()) for _ in range(4)]
    assert [r.status for r in leases] == [200] * 4
    waiter = asyncio.ensure_future(client.post("/admit", json=admit_body(prompt_tokens=950)))
    await asyncio.sleep(1.5)  # a 10-token request would have been refused at ~0.9 s
    assert not waiter.done()
    ticket = (await leases[0].json())["ticket"]
    assert (await client.post("/release", json={"ticket": ticket})).status == 200
    assert (await asyncio.wait_for(waiter, 5)).status == 200


async def test_the_urgent_class_waits_into_the_margin_and_still_runs(
    redis: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The most urgent class is refused only past 90 % of its target (`URGENT_MARGIN`), not
    75 % as the others: nothing inside the engine goes before it. A request of it that waited
    into that last quarter still runs when a slot frees there — and the class reads as past
    capacity from then on, as if refused (the signal for the early refusals and the own decode
    guard keeps the 75 % point). Realtime's target set to 4 s here, so that the slot frees
    between the two points with room on each side (3.0, 3.25, 3.6 s)."""
    text = LATE_POLICY.replace("slo: {ttft_ms: 1000}", "slo: {ttft_ms: 4000}")
    client = await started(text, redis, redis_server, tmp_path)
    try:
        dispatcher = client.server.app[DISPATCHER]
        leases = [await client.post("/admit", json=admit_body()) for _ in range(4)]
        assert [r.status for r in leases] == [200] * 4
        waiter = asyncio.ensure_future(client.post("/admit", json=admit_body()))
        await asyncio.sleep(3.25)
        assert not waiter.done()  # past 75 % of its target, still waiting
        assert dispatcher.overload.late("m", "realtime", dispatcher.clock())
        ticket = (await leases[0].json())["ticket"]
        assert (await client.post("/release", json={"ticket": ticket})).status == 200
        assert (await asyncio.wait_for(waiter, 5)).status == 200
        data = await (await client.get("/status.json")).json()
        rows = {c["class"]: c for c in data["queue"]["classes"]}
        assert rows["realtime"]["late_refused_60s"] == 0
    finally:
        await client.close()


def test_the_urgent_class_is_gated_by_its_prefill_budget_only_when_it_refuses_late() -> None:
    node = Node(id="n1", url="http://127.0.0.1:1", models=("m",), max_inflight=4)
    v = NodeView(node)
    v.prefill_rate = 10_000.0
    for text, budget in ((BASE_POLICY, 0), (LATE_POLICY, 10_000)):
        urgent = text.replace("priority: 0,", "priority: 0, admit_until: drain,")
        policy = make_policy("redis://127.0.0.1:1/0", urgent)
        ask = ask_for(v, policy, Request("m", "realtime", 100, 200), decode_s=None)
        assert ask.urgent and ask.prefill_budget == budget
        assert (
            ask_for(v, policy, Request("m", "batch", 100, 200), decode_s=None).prefill_budget
            == 10_000
        )
    # The shipped policy: realtime and batch refuse late, offline serves late.
    shipped = load_policy(DEFAULT_POLICY)
    assert shipped.classes["batch"].on_late == OnLate.REFUSE
    assert shipped.classes["realtime"].on_late == OnLate.REFUSE
    assert shipped.classes["offline"].on_late == OnLate.SERVE


async def test_past_capacity_a_tenant_over_its_share_is_refused_at_arrival(
    sidecar: Any, redis: Any
) -> None:
    """The wiring of shedding.py: while realtime is being refused late and arrivals find no
    node, the weight-1 tenant asking as much as the weight-5 one is refused at arrival (429
    over_fair_share, nothing charged), the weight-5 one is not; the status page and metric
    show it. Its arithmetic is tests/test_shedding.py's."""
    from admission.server import DISPATCHER

    client = sidecar
    d = client.server.app[DISPATCHER]
    # Refused on arrival, before any limit is charged: no request needs to reach a node.
    shed, now = d.place.shed, d.clock()
    for i in range(50):  # the last 5 s: both asked 100 a second, 60 a second was admitted
        t = now - 5 + i * 0.1
        for tenant in ("acme", "small"):
            shed.arrive("m", "realtime", tenant, 10, t, lambda _t: 1.0, False)
        shed.admitted("m", "realtime", 6, t)
    assert (await client.post("/admit", json=admit_body(tenant="small"))).status == 200
    d.overload.refused_late("m", "realtime", d.clock())  # past capacity ...
    d.overload.no_node("m", "realtime", d.clock())  # ... and arrivals find no node
    bucket = keys.tenant_keys("small", "x")[1]
    codes = []
    for _ in range(4):
        before = await redis.hgetall(bucket)
        r = await client.post("/admit", json=admit_body(tenant="small", max_tokens=1))
        codes.append((r.status, (await r.json()).get("error", {}).get("code")))
        if codes[-1] == (429, "over_fair_share"):
            assert int(r.headers["Retry-After"]) >= 1
            assert await redis.hgetall(bucket) == before  # nothing charged
    assert codes.count((429, "over_fair_share")) >= 2, codes
    r = await client.post("/admit", json=admit_body(tenant="acme"))
    assert r.status == 200  # acme (weight 5): half of its asks are over its share, not this one
    data = await (await client.get("/status.json")).json()
    shown = {(f["class"], f["tenant"]): f["share"] for f in data["fair_shed"]}
    assert shown[("realtime", "small")] > 0.8 > 0.5 > shown[("realtime", "acme")] > 0
    assert any(g["reason"] == "over_fair_share" for g in data["refusals"])
    assert {"model": "m", "class": "realtime", "state": "shedding"} in data["overload"]
    metrics = await (await client.get("/metrics")).text()
    assert 'admission_fair_shed_total{cls="realtime"}' in metrics
