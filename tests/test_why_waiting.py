"""What keeps each class waiting, as the status page says it (`held` in /status.json) and as
`admission_held_checks_total` counts it: the node rules that said no to queued requests that
found no node, in the policy's words, over about the last minute. A real sidecar on a real
redis-server; the node's state is what its agent would publish."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from admission.metrics import Metrics, Rolling
from admission.nodes.state import NodeState, Status
from admission.policy import load_policy
from admission.reload import PolicyHolder
from admission.scheduling.gates import GATE_REASONS
from admission.server import build_app
from admission.status import waits_for
from admission.store import keys
from devstack.procs import RedisServer
from devstack.stack import DEFAULT_POLICY
from tests.conftest import BASE_POLICY, make_policy

# Realtime as shipped: admitted until drain, TTFT 1 s, e2e 10 s, 60 ms per output token.
SLO = "admit_until: drain, slo: {ttft_ms: 1000, e2e_ms: 10000, tpot_ms: 60}"


async def set_node(redis: Any, tpot_s: float, seq: int) -> None:
    st = NodeState(
        node="n1",
        seq=seq,
        state=Status.OPEN,
        source="kv",
        healthy=True,
        memory=0.3,
        tpot_s=tpot_s,
        decode_s=tpot_s,
    )
    await redis.set(keys.node_state("n1"), st.to_json(), px=60_000)


@pytest.fixture
async def client(
    redis: Any, redis_server: RedisServer, tmp_path: Path
) -> AsyncIterator[TestClient[Any, Any]]:
    text = BASE_POLICY.replace("deadline_s: 5}", f"deadline_s: 5, {SLO}}}")
    path = tmp_path / "policies.yaml"
    path.write_text(text.replace("REDIS_URL", redis_server.url))
    await set_node(redis, tpot_s=0.2, seq=1)  # decode at 200 ms a token: past realtime's 60
    c = TestClient(TestServer(build_app(PolicyHolder(path, load_policy(path), Metrics()))))
    await c.start_server()
    yield c
    await c.close()


def body(**kw: Any) -> dict[str, Any]:
    return {"tenant": "acme", "model": "m", "prompt_tokens": 10, "max_tokens": 90, **kw}


async def held(client: TestClient[Any, Any], cls: str, reason: str) -> dict[str, Any]:
    """The status page's row for `cls` once `reason` heads it (what an operator sees)."""
    row: dict[str, Any] = {}
    for _ in range(100):
        data = await (await client.get("/status.json")).json()
        row = next((h for h in data["held"]["classes"] if h["class"] == cls), {})
        if row and row["reasons"][0]["reason"] == reason:
            return row
        await asyncio.sleep(0.05)
    raise AssertionError(f"{cls} not held by {reason}: {data['held']}")


async def test_the_status_page_says_which_rule_keeps_a_class_waiting(
    client: TestClient[Any, Any], redis: Any
) -> None:
    # Realtime runs on n1 (its KV booked: the decode guard acts) and n1 decodes at 200 ms a
    # token: batch waits for the decode guard, and the page says which target holds it.
    assert (await client.post("/admit", json=body())).status == 200
    batch = asyncio.ensure_future(client.post("/admit", json=body(**{"class": "batch"})))
    row = await held(client, "batch", "decode")
    assert row["checks"] >= 1 and row["reasons"][0]["share"] == 1.0
    assert "classes.realtime.slo.tpot_ms: 60 ms" in row["why"]
    metrics = await (await client.get("/metrics")).text()
    assert 'admission_held_checks_total{cls="batch",reason="decode"}' in metrics
    # Realtime never waited: no row. The node's decode recovers: batch goes.
    data = await (await client.get("/status.json")).json()
    assert [h["class"] for h in data["held"]["classes"]] == ["batch"]
    assert 0 < data["held"]["span_s"] <= 61
    await set_node(redis, tpot_s=0.01, seq=2)
    assert (await asyncio.wait_for(batch, 5)).status == 200

    # n1 takes 4 in flight: the fifth realtime request waits for a slot, and says so.
    for _ in range(2):
        assert (await client.post("/admit", json=body())).status == 200
    fifth = asyncio.ensure_future(client.post("/admit", json=body()))
    row = await held(client, "realtime", "inflight")
    assert "nodes.<id>.max_inflight" in row["why"]
    fifth.cancel()
    await asyncio.gather(fifth, return_exceptions=True)


def test_the_held_window_keeps_about_the_last_minute() -> None:
    tally: Counter[tuple[str, str]] = Counter()
    window = Rolling(tally, keep_s=60.0, every_s=1.0)
    window.tick(100.0)
    tally[("batch", "decode")] += 5  # counted in the first minute: shown since the start
    for t in range(101, 131):
        window.tick(float(t))
    assert window.since(130.0) == (30.0, Counter({("batch", "decode"): 5}))
    for t in range(131, 200):
        window.tick(float(t))
    tally[("batch", "prefill")] += 2
    span, counts = window.since(199.5)
    assert 60.0 <= span <= 61.5  # the last minute, to a tick
    assert counts == Counter({("batch", "prefill"): 2})  # the decode checks are past it
    assert len(window.copies) <= 63  # bounded: a copy a second


def test_every_node_rule_is_said_in_the_shipped_policys_terms() -> None:
    policy = load_policy(DEFAULT_POLICY)
    for cls in ("realtime", "batch"):
        for reason in GATE_REASONS:
            words = waits_for(policy, cls, reason)
            assert words != reason, (cls, reason)
            assert any(k in words for k in ("watermarks.", "classes.", "nodes.", "node list"))
    assert "watermarks.drain (0.85)" in waits_for(policy, "realtime", "measured")
    assert "watermarks.hold (0.80)" in waits_for(policy, "batch", "booked")
    assert "only idle prefill where realtime runs" in waits_for(policy, "batch", "prefill")
    assert "watermarks.reopen (0.75)" in waits_for(policy, "batch", "state")
    assert "held" not in waits_for(policy, "realtime", "state")  # it goes to held nodes
    # A policy with no class admitted until drain, nor SLOs: words still, never an error.
    bare = make_policy("redis://127.0.0.1:1/0")
    assert all(waits_for(bare, "batch", r) for r in GATE_REASONS)
