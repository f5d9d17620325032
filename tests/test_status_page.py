"""The live status page, rendered by a real headless Chromium against a real sidecar (and
redis-server): the numbers on the page are the live ones, and it draws something."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from admission.metrics import Metrics
from admission.nodes.state import NodeState, Status
from admission.policy import load_policy
from admission.reload import PolicyHolder
from admission.server import METRICS, build_app
from admission.store import keys
from devstack.procs import RedisServer
from tests.conftest import BASE_POLICY

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (scripts/setup.sh --vllm-cpu)"),
]


@pytest.fixture
async def sidecar(
    redis: Any, redis_server: RedisServer, tmp_path: Path
) -> AsyncIterator[tuple[TestClient[Any, Any], PolicyHolder]]:
    path = tmp_path / "policies.yaml"
    # No aging nor timeouts while the page renders (Chromium can take seconds on a loaded machine): the queued
    # batch request must still be batch when the page is read.
    text = BASE_POLICY.replace("REDIS_URL", redis_server.url)
    text = text.replace("priority: 0, deadline_s: 5}", "priority: 0, deadline_s: 60}")
    path.write_text(
        text.replace("deadline_s: 10, promote_after_s: 2}", "deadline_s: 60, promote_after_s: 120}")
    )
    holder = PolicyHolder(path, load_policy(path), Metrics())
    st = NodeState(
        node="n1",
        seq=1,
        state=Status.OPEN,
        source="kv",
        healthy=True,
        memory=0.42,
        prefix_hit_ratio=0.625,
        tpot_s=0.08,
        decode_s=0.03,
    )
    await redis.set(keys.node_state("n1"), st.to_json(), px=60_000)
    client = TestClient(TestServer(build_app(holder), host="127.0.0.1"))
    await client.start_server()
    yield client, holder
    await client.close()


async def chromium(*args: str) -> bytes:
    assert CHROMIUM is not None
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--virtual-time-budget=4000",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0
    return out


def admit(**kw: Any) -> dict[str, Any]:
    return {"tenant": "acme", "model": "m", "prompt_tokens": 10, "max_tokens": 90, **kw}


async def test_status_page_shows_the_live_queue_nodes_and_refusals(
    sidecar: Any, tmp_path: Path
) -> None:
    client, holder = sidecar
    # n1 takes 4 in flight: 4 admitted, then 3 of acme queue (2 realtime, 1 batch); `small`
    # (request burst 2) sends 3 at once: 2 queue, 1 is refused at once.
    for _ in range(4):
        assert (await client.post("/admit", json=admit())).status == 200
    waiting = [
        asyncio.ensure_future(client.post("/admit", json=admit(**kw)))
        for kw in ({}, {}, {"class": "batch"}, *[{"tenant": "small"}] * 3)
    ]
    # The engines' prompt count over the edge's estimate (releases observe it: test_server).
    client.server.app[METRICS].prompt_ratio.observe(3.2)
    try:
        await check_page(client, holder, tmp_path)
    finally:
        for f in waiting:
            f.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)


async def check_page(client: Any, holder: PolicyHolder, tmp_path: Path) -> None:
    for _ in range(100):
        data = await (await client.get("/status.json")).json()
        if data["queue"]["total"] == 5 and data["refusals"]:
            break
        await asyncio.sleep(0.05)
    assert data["queue"]["total"] == 5 and data["refusals"][0]["reason"] == "requests_per_s"
    assert data["refusals"][0]["count"] == 1

    url = str(client.make_url("/status"))
    dom = (await chromium("--dump-dom", url)).decode()
    text = re.sub(r"<(script|style)>.*?</(script|style)>", " ", dom, flags=re.S)
    text = re.sub(r"<[^>]+>", " ", text)
    text = re.sub(r"\s+", " ", text)
    # Rendered by the page's script from /status.json, not in the static HTML.
    assert holder.version in text and len(holder.version) == 12
    # Which sidecar, and in which zone its times are (issue 63).
    assert f"{socket.gethostname()} pid {os.getpid()}" in text
    assert "times in UTC" in text and re.search(r"loaded \d\d:\d\d:\d\dZ", text)
    assert re.search(r"realtime 4 [\d.]+ s", text), text[:2000]  # class, depth, oldest wait
    assert re.search(r"batch 1 [\d.]+ s", text)
    assert "realtime acme 2" in text and "realtime small 2" in text  # by tenant
    assert "batch acme 1" in text
    assert re.search(r"n1 open .*42\.0 %", text)  # node, state, measured memory
    assert "4 / 4" in text  # in flight / cap
    assert re.search(r"4 / 4 \d+ 62\.5 %", text)  # pending prefill, the engine's prefix cache hits
    assert "62.5 % 80 / 30 ms" in text  # time per output token: last sample / last second
    assert data["nodes"][0]["prefix_cache_hit_ratio"] == 0.625
    assert "small realtime requests_per_s 1" in text  # the refusal, counted
    # Why they wait: n1 is at its in-flight cap (checks, not requests; in policy terms).
    assert re.search(r"realtime \d+ inflight 100\.0 % nodes at their in-flight cap", text)
    assert re.search(r"batch \d+ inflight 100\.0 %", text)
    assert "engines counted 3.20× the edge's prompt estimate" in text
    assert (
        "Answers booked model class tenant tokens learned from none learned yet: requests book"
        in text
    )
    assert "never" not in text and "stale" not in text  # it did fetch, and recently

    shot = tmp_path / "status.png"
    await chromium(f"--screenshot={shot}", "--window-size=1280,860", url)
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    assert img.size == (1280, 860)
    colors = img.getcolors(maxcolors=1 << 16) or []
    assert len(colors) > 50  # text, tables and bars, not a blank page
    greens = sum(n for n, (r, g, b) in colors if g > 110 and r < 60 and b < 90)  # "open" in green
    assert greens > 10


async def test_status_json_is_read_only_and_carries_no_secrets(sidecar: Any) -> None:
    client, _holder = sidecar
    assert (await client.post("/status.json")).status == 405
    body = await (await client.get("/status.json")).text()
    assert "sk-acme" not in body and "plain:" not in body
    doc = json.loads(body)
    assert set(doc) == {
        "now",
        "sidecar",
        "policy",
        "redis",
        "queue",
        "waits",
        "nodes",
        "pressure",
        "decode_guard",
        "answers_booked",
        "fair_shed",
        "overload",
        "prefix",
        "refusals",
        "held",
        "demand",
    }
    assert doc["fair_shed"] == [] and doc["overload"] == []  # no class past capacity
    assert doc["answers_booked"] == []  # no answer learned yet: every request books its cap
    # No release has reported cached tokens yet: the booking and the engines' count are unknown.
    assert doc["prefix"] == {
        "booked_cached_tokens": None,
        "engine_cached_tokens": None,
        "engine_prompt_ratio": None,
    }
