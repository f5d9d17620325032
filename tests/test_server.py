"""The sidecar API against a real redis-server; node states written as an agent would."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from admission.metrics import Metrics
from admission.nodes.state import NodeState, Status
from admission.policy import load_policy
from admission.reload import PolicyHolder
from admission.server import build_app
from admission.store import keys
from devstack.procs import RedisServer
from tests.conftest import BASE_POLICY


async def set_node(
    redis: Any,
    node: str,
    state: str = "open",
    memory: float = 0.1,
    seq: int = 1,
    per_token: float = 0.0,
    base_memory: float = 0.0,
    prefill_rate: float = 0.0,
) -> None:
    st = NodeState(
        node=node,
        seq=seq,
        state=Status(state),
        source="kv",
        healthy=True,
        memory=memory,
        per_token=per_token,
        base_memory=base_memory,
        prefill_rate=prefill_rate,
    )
    await redis.set(keys.node_state(node), st.to_json(), px=5000)


@pytest.fixture
async def sidecar(
    redis: Any, redis_server: RedisServer, tmp_path: Path
) -> AsyncIterator[tuple[TestClient[Any, Any], PolicyHolder, Path]]:
    path = tmp_path / "policies.yaml"
    path.write_text(BASE_POLICY.replace("REDIS_URL", redis_server.url))
    holder = PolicyHolder(path, load_policy(path), Metrics())
    await set_node(redis, "n1")
    app = build_app(holder, edge_table=tmp_path / "edge.json")
    client = TestClient(TestServer(app))
    await client.start_server()
    yield client, holder, path
    await client.close()


def admit_body(**kw: Any) -> dict[str, Any]:
    body = {"tenant": "acme", "model": "m", "prompt_tokens": 10, "max_tokens": 90, "stream": False}
    body.update(kw)
    return body


async def test_admit_and_release_refunds(sidecar: Any, redis: Any) -> None:
    client, _h, _p = sidecar
    r = await client.post("/admit", json=admit_body())
    assert r.status == 200
    adm = await r.json()
    assert adm["node"] == "n1" and adm["url"] == "http://127.0.0.1:1"
    assert adm["priority"] == 1  # realtime's (0) × 2 + 1: nothing of the prompt cached
    assert adm["class"] == "realtime"
    assert await redis.zcard(keys.node_leases("n1")) == 1
    r = await client.post(
        "/release",
        json={
            "ticket": adm["ticket"],
            "status": 200,
            "usage": {"prompt_tokens": 10, "completion_tokens": 20},
        },
    )
    assert (await r.json())["refunded_tokens"] == 70
    assert await redis.zcard(keys.node_leases("n1")) == 0
    r = await client.post("/release", json={"ticket": adm["ticket"], "status": 200, "usage": None})
    assert (await r.json())["refunded_tokens"] == 0  # idempotent


async def test_the_engines_prompt_count_against_the_edges_estimate_is_a_metric(
    sidecar: Any,
) -> None:
    # The edge sends its estimate beside the engine's usage; the sidecar observes their ratio
    # (one release, and a batch), and refuses an estimate that is not a count.
    client, _h, _p = sidecar

    async def ticket() -> str:
        return str((await (await client.post("/admit", json=admit_body())).json())["ticket"])

    usage = {"prompt_tokens": 320, "completion_tokens": 5}
    one = {"ticket": await ticket(), "status": 200, "usage": usage, "estimate": 100}
    assert (await client.post("/release", json=one)).status == 200
    batch = [
        {"ticket": await ticket(), "status": 200, "usage": usage, "estimate": 300},
        {"ticket": await ticket(), "status": 200, "usage": None, "estimate": 300},  # no usage
        {"ticket": await ticket(), "status": 200, "usage": usage},  # an older edge: no estimate
        {"ticket": await ticket(), "status": 200, "usage": usage, "estimate": "100"},
    ]
    results = (await (await client.post("/release", json=batch)).json())["results"]
    assert [r.get("error", {}).get("code") for r in results] == [
        None,
        None,
        None,
        "invalid_request",
    ]
    text = await (await client.get("/metrics")).text()
    assert "admission_prompt_tokens_ratio_count 2.0" in text
    assert "admission_prompt_tokens_ratio_sum 4.2666" in text  # 3.2 + 320 / 300
    assert 'admission_prompt_tokens_ratio_bucket{le="1.1"} 1.0' in text
    assert 'admission_prompt_tokens_ratio_bucket{le="4.0"} 2.0' in text
    doc = await (await client.get("/status.json")).json()
    assert doc["prefix"]["engine_prompt_ratio"] == pytest.approx(4.2667 / 2, abs=1e-3)


@pytest.mark.parametrize(
    ("status", "header_s", "refunded"),
    [
        (0, None, 100),  # no upstream answered
        (502, None, 100),  # NGINX could not connect, or the engine closed unanswered
        (502, 0.01, 0),  # NGINX's 502 for what a live engine sent: it may have worked
        (503, 0.01, 100),  # the engine's queue was full
        (400, 0.01, 100),  # refused by validation, in milliseconds
        (422, 0.2, 100),
        (429, 0.01, 100),
        (400, 2.5, 0),  # a 400 after generating (tool_choice "required", cut short)
        (400, None, 0),  # a 4xx nobody timed: not evidence that nothing ran
        (500, 0.01, 0),
        (504, None, 0),
        (499, None, 0),
        (200, 0.01, 0),
    ],
)
async def test_release_without_usage_refunds_only_what_no_engine_ran(
    sidecar: Any, status: int, header_s: float | None, refunded: int
) -> None:
    # Nothing ran: no engine answered, or it refused the request quickly (invalid, or its
    # queue full): full refund. A slow 4xx, a 500, a 504 (the proxy timed out a long
    # generation) or a 499 (the client left mid-generation) may have generated up to the cap.
    client, _h, _p = sidecar
    adm = await (await client.post("/admit", json=admit_body())).json()
    body = {"ticket": adm["ticket"], "status": status, "header_s": header_s}
    r = await client.post("/release", json=body)
    assert (await r.json())["refunded_tokens"] == refunded


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 10, "completion_tokens": None},  # cjson.null from the edge
        {"prompt_tokens": 10},
        {"prompt_tokens": -1, "completion_tokens": 3},
        {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 11},
        },
    ],
)
async def test_unreadable_usage_still_releases_and_keeps_the_charge(
    sidecar: Any, redis: Any, usage: dict[str, Any]
) -> None:
    # A release whose usage cannot be read used to be refused as a whole (400): its lease then
    # stayed booked until lease_ttl_s. Now the lease goes back and the reservation stays.
    client, _h, _p = sidecar
    adm = await (await client.post("/admit", json=admit_body())).json()
    assert await redis.zcard(keys.node_leases("n1")) == 1
    r = await client.post("/release", json={"ticket": adm["ticket"], "status": 200, "usage": usage})
    assert r.status == 200 and (await r.json())["refunded_tokens"] == 0
    assert await redis.zcard(keys.node_leases("n1")) == 0


async def test_release_batch_answers_each_entry(sidecar: Any, redis: Any) -> None:
    client, _h, _p = sidecar
    tickets = [
        (await (await client.post("/admit", json=admit_body())).json())["ticket"] for _ in range(2)
    ]
    batch = [
        {
            "ticket": tickets[0],
            "status": 200,
            "usage": {"prompt_tokens": 10, "completion_tokens": 0},
        },
        {"ticket": "garbage"},
        {"ticket": tickets[1]},
    ]
    r = await client.post("/release", json=batch)
    body = await r.json()
    assert r.status == 200 and body["released"] == 2
    assert body["results"][0] == {"refunded_tokens": 90}
    assert body["results"][1]["error"]["code"] == "invalid_ticket"
    assert await redis.zcard(keys.node_leases("n1")) == 0


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1]", 400, "invalid_json"),
        (json.dumps(admit_body(colour="red")).encode(), 400, "unknown_field"),
        (json.dumps(admit_body(max_tokens=-1)).encode(), 400, "invalid_request"),
        (json.dumps(admit_body(max_tokens="9")).encode(), 400, "invalid_request"),
        (json.dumps(admit_body(prompt_tokens=True)).encode(), 400, "invalid_request"),
        (json.dumps(admit_body(tenant="nobody")).encode(), 401, "invalid_api_key"),
        (
            json.dumps(admit_body(tenant="small", **{"class": "batch"})).encode(),
            403,
            "class_not_allowed",
        ),
        (json.dumps(admit_body(model="gpt-9")).encode(), 404, "model_not_found"),
        (b"x" * 70_000, 400, "body_too_large"),
    ],
)
async def test_bad_input_is_rejected_and_debits_nothing(
    sidecar: Any, redis: Any, raw: bytes, status: int, code: str
) -> None:
    client, _h, _p = sidecar
    r = await client.post("/admit", data=raw, headers={"Content-Type": "application/json"})
    assert r.status == status
    body = await r.json()
    assert body["error"]["code"] == code and body["error"]["message"]
    assert await redis.keys("adm:{t:*") == []


async def test_throttled_tenant_gets_429_with_retry_after(sidecar: Any) -> None:
    client, _h, _p = sidecar
    codes = []
    for _ in range(3):
        r = await client.post("/admit", json=admit_body(tenant="small", max_tokens=10))
        codes.append(r.status)
    assert codes == [200, 200, 429]
    assert r.headers["Retry-After"] == "1"
    assert (await r.json())["error"]["code"] == "requests_per_s"


async def test_request_larger_than_bucket_is_400(sidecar: Any) -> None:
    client, _h, _p = sidecar
    r = await client.post("/admit", json=admit_body(tenant="small", max_tokens=301))
    assert r.status == 400 and "Retry-After" not in r.headers
    assert (await r.json())["error"]["code"] == "request_exceeds_limit"


async def test_queue_timeout_refunds_tokens(sidecar: Any, redis: Any) -> None:
    """Past its deadline with its only node down: 503 `no_capacity` (no node can serve it, not
    a queue too slow: issue 63), Retry-After, the reservation refunded; with a node up but
    full, `queue_timeout`."""
    client, holder, path = sidecar
    path.write_text(path.read_text().replace("deadline_s: 5", "deadline_s: 0.3"))
    assert holder.reload()
    await set_node(redis, "n1", state="down")
    await asyncio.sleep(0.25)  # the dispatcher's next refresh sees it
    r = await client.post("/admit", json=admit_body(max_tokens=1000))
    assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
    assert (await r.json())["error"]["code"] == "no_capacity"
    assert r.headers["x-ratelimit-remaining-requests"] != "0"  # the buckets as they are
    level = int(await redis.hget(keys.tenant_keys("acme", "x")[1], "l") or 0)
    assert level == 0 or level >= 5000 * 10**6 - 10**6  # refunded (key deleted when full)
    await set_node(redis, "n1", state="hold", memory=0.82, seq=2)  # up, and held
    await asyncio.sleep(0.25)
    r = await client.post("/admit", json=admit_body(max_tokens=10))
    assert r.status == 503 and (await r.json())["error"]["code"] == "queue_timeout"


async def test_hold_waits_then_admits_when_memory_frees(sidecar: Any, redis: Any) -> None:
    client, _h, _p = sidecar
    await set_node(redis, "n1", state="hold", memory=0.82)
    await asyncio.sleep(0.25)
    pending = asyncio.ensure_future(client.post("/admit", json=admit_body()))
    await asyncio.sleep(0.5)
    assert not pending.done()  # held, not rejected
    await set_node(redis, "n1", state="open", memory=0.5, seq=2)
    r = await asyncio.wait_for(pending, 3)
    assert r.status == 200 and (await r.json())["queued_ms"] >= 400


async def test_ledger_holds_a_burst_until_releases_free_its_kv(sidecar: Any, redis: Any) -> None:
    # Each batch request reserves 200 tokens of KV = 0.2 of the node. From a base of 0.3, two
    # are admitted (0.3 → 0.5 → 0.7 < hold 0.8); the third would reach 0.9 and waits although
    # every sample still reads 0.3 (the KV of the first two has not shown yet) — until a
    # release takes its reservation out of the node's ledger.
    client, _h, _p = sidecar
    await set_node(redis, "n1", memory=0.3, per_token=0.001, base_memory=0.3)
    await asyncio.sleep(0.25)
    body = admit_body(prompt_tokens=100, max_tokens=100, **{"class": "batch"})
    tickets = []
    for _ in range(2):
        r = await client.post("/admit", json=body)
        assert r.status == 200
        tickets.append((await r.json())["ticket"])
    pending = asyncio.ensure_future(client.post("/admit", json=body))
    await asyncio.sleep(0.15)
    await set_node(redis, "n1", memory=0.3, per_token=0.001, base_memory=0.3, seq=2)
    await asyncio.sleep(0.6)
    assert not pending.done()  # a new sample does not forget what was booked
    assert int(await redis.hget(keys.node_ledger("n1"), "kv")) == 400
    await client.post("/release", json={"ticket": tickets[0], "status": 200, "usage": None})
    r = await asyncio.wait_for(pending, 3)
    assert r.status == 200 and (await r.json())["queued_ms"] >= 700


async def test_prefill_budget_keeps_batch_backlog_out_of_the_engine(
    sidecar: Any, redis: Any
) -> None:
    # The node clears 1,000 prompt tokens/s; realtime's TTFT target is 1 s (BASE_POLICY has no
    # SLO: the default target is 1 s), so batch gets at most ~1,000 tokens of pending prefill
    # on it. An idle node takes one request whatever its size; realtime is never held by it.
    client, _h, _p = sidecar
    await set_node(redis, "n1", memory=0.1, prefill_rate=1000.0)
    await asyncio.sleep(0.25)
    big = admit_body(prompt_tokens=900, max_tokens=10, **{"class": "batch"})
    assert (await client.post("/admit", json=big)).status == 200  # idle node: taken
    started = time.monotonic()
    second = asyncio.ensure_future(client.post("/admit", json=big))
    await asyncio.sleep(0.3)
    assert not second.done()  # 900 pending + 900 > 1,000: waits in the sidecar
    r = await client.post("/admit", json=admit_body(prompt_tokens=900, max_tokens=10))
    assert r.status == 200  # realtime (admitted until drain) is not gated by the budget
    r = await asyncio.wait_for(second, 5)
    assert r.status == 200 and time.monotonic() - started >= 0.7  # after the backlog drained


async def test_inflight_cap_and_client_disconnect_frees_queue_slot(
    sidecar: Any, redis: Any
) -> None:
    client, _h, _p = sidecar
    tickets = []
    for _ in range(4):  # max_inflight 4
        r = await client.post("/admit", json=admit_body(max_tokens=10))
        body = await r.json()
        assert r.status == 200, body
        tickets.append(body["ticket"])
    url = str(client.make_url("/admit"))
    async with aiohttp.ClientSession() as s:
        waiting = asyncio.ensure_future(s.post(url, json=admit_body(max_tokens=10)))
        await asyncio.sleep(0.4)
        h = await client.get("/healthz")
        assert (await h.json())["queued"] == 1
        waiting.cancel()  # the client goes away
        with pytest.raises(asyncio.CancelledError):
            await waiting
    await asyncio.sleep(0.3)
    assert (await (await client.get("/healthz")).json())["queued"] == 0
    await client.post("/release", json={"ticket": tickets[0], "status": 200, "usage": None})
    r = await client.post("/admit", json=admit_body(max_tokens=10))
    assert r.status == 200
    assert await redis.zcard(keys.node_leases("n1")) == 4


async def test_hot_reload_valid_swap_invalid_kept(sidecar: Any, tmp_path: Path) -> None:
    client, holder, path = sidecar
    path.write_text(path.read_text().replace("max_inflight: 4", "max_inflight: 9"))
    for _ in range(40):
        await asyncio.sleep(0.1)
        if holder.current.nodes["n1"].max_inflight == 9:
            break
    assert holder.current.nodes["n1"].max_inflight == 9  # picked up by the file watcher
    edge = json.loads((tmp_path / "edge.json").read_text())
    assert set(edge["tenants"]) == {"acme", "small"} and "sk-acme" not in json.dumps(edge)
    path.write_text(path.read_text().replace("hold: 0.8,", "hold: 0.9,"))
    for _ in range(40):
        await asyncio.sleep(0.1)
        m = await (await client.get("/metrics")).text()
        if 'admission_policy_reloads_total{result="invalid"} 1.0' in m:
            break
    assert 'admission_policy_reloads_total{result="invalid"} 1.0' in m
    assert holder.current.watermarks.hold == 0.8  # running policy stays
    assert "admission_policy_file_rejected 1.0" in m  # the alert fires while the file is bad
    r = await client.post("/admit", json=admit_body())
    assert r.status == 200
    # The good file restored (the running policy unchanged): the alert stops, a line says so.
    path.write_text(path.read_text().replace("hold: 0.9,", "hold: 0.8,"))
    assert holder.reload()
    assert "admission_policy_file_rejected 0.0" in await (await client.get("/metrics")).text()


async def test_metrics_count_decisions_without_secrets(sidecar: Any) -> None:
    client, _h, _p = sidecar
    await client.post("/admit", json=admit_body())
    await client.post("/admit", json=admit_body(model="nope"))
    text = await (await client.get("/metrics")).text()
    assert (
        'admission_decisions_total{cls="realtime",outcome="admitted",reason="ok",tenant="acme"} 1.0'
        in text
    )
    assert "admission_decision_seconds_bucket" in text
    assert "sk-acme" not in text


async def test_release_rejects_garbage(sidecar: Any) -> None:
    client, _h, _p = sidecar
    r = await client.post("/release", json={"ticket": "nope"})
    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_ticket"


async def test_urgent_class_flows_to_held_node_lower_class_waits(sidecar: Any, redis: Any) -> None:
    client, holder, path = sidecar
    text = (
        path.read_text()
        .replace(
            "realtime: {weight: 8, min_share: 0.1, priority: 0, deadline_s: 5}",
            "realtime: {weight: 8, min_share: 0.1, priority: 0, deadline_s: 5, admit_until: drain}",
        )
        .replace("deadline_s: 10, promote_after_s: 2", "deadline_s: 0.6, promote_after_s: 2")
    )
    path.write_text(text)
    assert holder.reload() and holder.current.classes["realtime"].admit_until == "drain"
    await set_node(redis, "n1", state="hold", memory=0.82)
    await asyncio.sleep(0.25)
    r = await client.post("/admit", json=admit_body(**{"class": "realtime"}))
    assert r.status == 200  # held node, but realtime is admitted until drain
    r = await client.post("/admit", json=admit_body(**{"class": "batch"}))
    assert r.status == 503  # batch waited for the hold to clear, until its deadline


async def test_a_reasked_request_keeps_its_arrival_time(sidecar: Any, redis: Any) -> None:
    # The request waited 3.8 s at a sidecar that died; re-asked here it has 0.2 s of its 4 s
    # (realtime: 5 s in BASE_POLICY, so 1.2 s) deadline left, not a fresh one.
    client, _h, _p = sidecar
    await set_node(redis, "n1", state="hold", memory=0.82)  # held: it waits out its deadline
    await asyncio.sleep(0.25)
    started = time.monotonic()
    r = await client.post("/admit", json=admit_body(arrived_at=time.time() - 3.8))
    assert r.status == 503 and (await r.json())["error"]["code"] == "queue_timeout"
    assert time.monotonic() - started < 4.0  # 5 - 3.8 = 1.2 s, not a fresh 5 s
    r = await client.post("/admit", json=admit_body(arrived_at="yesterday"))
    assert r.status == 400


async def test_node_that_edge_cannot_reach_is_ejected(sidecar: Any, redis: Any) -> None:
    # Three proxied requests that could not reach n1 (within 10 s, from any sidecar): n1 is out
    # of rotation on every sidecar (a key in Redis) for 10 s; new requests wait for a node.
    client, _h, _p = sidecar
    tickets = [
        (await (await client.post("/admit", json=admit_body())).json())["ticket"] for _ in range(3)
    ]
    for t in tickets[:2]:
        await client.post("/release", json={"ticket": t, "status": 502, "node_failed": True})
    assert not await redis.exists(keys.node_eject("n1"))
    await client.post("/release", json={"ticket": tickets[2], "status": 502, "node_failed": True})
    assert 0 < await redis.pttl(keys.node_eject("n1")) <= 10_000
    nodes = await (await client.get("/nodes")).json()
    assert nodes["nodes"][0]["state"] == "down"
    assert 0 <= nodes["views_age_s"] < 5  # read from Redis lately (every 0.1–0.5 s)
    metrics = await (await client.get("/metrics")).text()
    assert 'admission_node_ejections_total{node="n1"} 1.0' in metrics
    assert "admission_node_views_age_seconds " in metrics


async def test_a_failed_release_sent_again_counts_once(sidecar: Any, redis: Any) -> None:
    # The edge re-sends a batch no sidecar confirmed: the same ticket must not count again
    # towards ejecting its node (three re-sends of one failure ejected a healthy node).
    client, _h, _p = sidecar
    ticket = (await (await client.post("/admit", json=admit_body())).json())["ticket"]
    for _ in range(4):
        body = {"ticket": ticket, "status": 502, "node_failed": True}
        assert (await client.post("/release", json=body)).status == 200
    assert not await redis.exists(keys.node_eject("n1"))
    assert await redis.scard(keys.node_fails("n1")) == 1


async def test_release_while_redis_refuses_writes_is_not_a_500(sidecar: Any, redis: Any) -> None:
    # OOM (maxmemory reached) came out of the node-failure count as a 500 for the whole batch:
    # the edge re-posted it every 0.5 s and none was applied. Now the release is answered, kept
    # and applied once Redis takes writes again.
    client, _h, _p = sidecar
    ticket = (await (await client.post("/admit", json=admit_body())).json())["ticket"]
    await redis.config_set("maxmemory", "1")
    try:
        body = [{"ticket": ticket, "status": 502, "node_failed": True}]
        r = await client.post("/release", json=body)
        assert r.status == 200, await r.text()
    finally:
        await redis.config_set("maxmemory", "0")
    for _ in range(50):
        if await redis.zcard(keys.node_leases("n1")) == 0:
            break
        await asyncio.sleep(0.1)
    assert await redis.zcard(keys.node_leases("n1")) == 0


async def test_releases_teach_the_decode_guard_how_long_urgent_answers_are(
    redis: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    # Realtime (admitted until drain) answers of 300 output tokens with e2e 10 s and TTFT 1 s:
    # lower classes must leave decode at ≤ 30 ms/token, not tpot_ms's 60. Only the engine's
    # usage counts, only for tickets admitted as urgent; batch answers and unknown usage do not.
    from admission.server import DISPATCHER

    slo = "slo: {ttft_ms: 1000, e2e_ms: 10000, tpot_ms: 60}"
    text = BASE_POLICY.replace("deadline_s: 5}", f"deadline_s: 5, admit_until: drain, {slo}}}")
    path = tmp_path / "policies.yaml"
    path.write_text(text.replace("REDIS_URL", redis_server.url))
    await set_node(redis, "n1")
    app = build_app(PolicyHolder(path, load_policy(path), Metrics()), edge_table=tmp_path / "e")
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        outputs = app[DISPATCHER].nodes.answers
        rt = [
            (await (await client.post("/admit", json=admit_body())).json())["ticket"]
            for _ in range(2)
        ]
        batch = await (await client.post("/admit", json=admit_body(**{"class": "batch"}))).json()
        assert batch["class"] == "batch"

        def usage(ticket: str, out: int) -> dict[str, Any]:
            return {
                "ticket": ticket,
                "status": 200,
                "usage": {"prompt_tokens": 10, "completion_tokens": out},
                "finish": "stop",
            }

        await client.post("/release", json=usage(batch["ticket"], 5))
        assert outputs.mean == 0  # not an urgent answer
        await client.post("/release", json={"ticket": rt[0], "status": 499})  # no usage
        assert outputs.mean == 0
        rt.append((await (await client.post("/admit", json=admit_body())).json())["ticket"])
        await client.post("/release", json=[usage(rt[1], 300), usage(rt[2], 100)])
        assert outputs.mean == pytest.approx(0.05 * 100 + 0.95 * 300)
        await client.post("/release", json=usage(rt[1], 5000))  # released twice: counted once
        assert outputs.mean == pytest.approx(290)
        await app[DISPATCHER].nodes.refresh()  # the ledger as Redis has it: all released
        data = await (await client.get("/status.json")).json()  # what an operator sees
        guard = {
            "urgent_output_tokens": 290.0,
            "limit_ms": 31.0,
            "active": False,
            "own_limit_ms": None,
            "own_active": False,
            "under_min_share": [],
        }
        assert data["decode_guard"] == guard  # no realtime booked anywhere: lower classes free
        await client.post("/admit", json=admit_body())  # realtime runs on n1 again
        data = await (await client.get("/status.json")).json()
        assert data["decode_guard"] == {**guard, "active": True}
    finally:
        await client.close()


async def test_answers_carry_the_tenants_buckets(sidecar: Any) -> None:
    # small: request burst 2, token burst 300. The admission says what is left of each bucket
    # (the edge turns it into OpenAI's x-ratelimit-* headers); a 429 says it on the HTTP route.
    client, _h, _p = sidecar
    first = await (await client.post("/admit", json=admit_body(tenant="small"))).json()
    rl = first["ratelimit"]
    assert rl["requests"] == 2 and rl["tokens"] == 300
    assert rl["requests_remaining"] == 1 and rl["tokens_remaining"] == 200  # 100 booked
    assert 0 < rl["requests_reset_s"] <= 1.0
    await client.post("/admit", json=admit_body(tenant="small"))
    r = await client.post("/admit", json=admit_body(tenant="small"))
    assert r.status == 429
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-limit-requests"] == "2"
    assert r.headers["x-ratelimit-reset-requests"].endswith("ms") or r.headers[
        "x-ratelimit-reset-requests"
    ].endswith("s")
