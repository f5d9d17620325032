"""The edge's admission socket (admission.edge_socket): one JSON line each way, the same answers
as /admit, and a connection that closes while its ask waits frees its queue slot."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from admission import edge_socket
from admission.metrics import Metrics
from admission.policy import load_policy
from admission.reload import PolicyHolder
from admission.server import build_app
from admission.store import keys
from devstack.procs import RedisServer
from tests.conftest import BASE_POLICY
from tests.test_server import admit_body, set_node, sidecar  # noqa: F401 (fixture)


@pytest.fixture
async def edge(sidecar: Any, tmp_path: Path) -> AsyncIterator[tuple[Any, str]]:  # noqa: F811
    client, _h, _p = sidecar
    path = str(tmp_path / "admit.sock")
    server, live = await edge_socket.serve(client.server.app, path, 64)
    yield client, path
    await edge_socket.drain(server, live, 1.0)


async def ask(path: str, *lines: bytes) -> list[dict[str, Any]]:
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        out = []
        for line in lines:
            writer.write(line + b"\n")
            await writer.drain()
            got = await asyncio.wait_for(reader.readline(), 10)
            out.append(json.loads(got) if got else {"closed": True})
        return out
    finally:
        writer.close()


async def test_same_answers_as_admit_on_one_connection(edge: Any, redis: Any) -> None:
    client, path = edge
    ok, unknown, bad_json, bad_field = await ask(
        path,
        json.dumps(admit_body()).encode(),
        json.dumps(admit_body(tenant="nobody")).encode(),
        b"{not json",
        json.dumps(admit_body(color="red")).encode(),
    )
    assert ok["status"] == 200 and ok["body"]["node"] == "n1" and ok["body"]["ticket"]
    assert await redis.zcard(keys.node_leases("n1")) == 1
    assert unknown["status"] == 401 and unknown["body"]["error"]["code"] == "invalid_api_key"
    assert bad_json["status"] == 400 and bad_json["body"]["error"]["code"] == "invalid_json"
    assert bad_field["status"] == 400 and bad_field["body"]["error"]["code"] == "unknown_field"
    # The HTTP route gives the same answer for the same ask.
    r = await client.post("/admit", json=admit_body(tenant="nobody"))
    assert r.status == 401 and (await r.json()) == unknown["body"]


async def test_an_empty_line_is_invalid_json(edge: Any) -> None:
    _client, path = edge
    (got,) = await ask(path, b"")
    assert got["status"] == 400 and got["body"]["error"]["code"] == "invalid_json"


async def test_refusals_carry_retry_after(edge: Any) -> None:
    _client, path = edge
    answers = await ask(path, *[json.dumps(admit_body(tenant="small", max_tokens=10)).encode()] * 3)
    assert [a["status"] for a in answers] == [200, 200, 429]
    assert (
        answers[2]["retry_after"] == 1 and answers[2]["body"]["error"]["code"] == "requests_per_s"
    )


@pytest.mark.parametrize("end", [b"", b"\n"])  # still arriving, or whole in one read
async def test_an_oversized_line_is_refused_and_the_connection_closed(
    edge: Any, end: bytes
) -> None:
    _client, path = edge
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(b"x" * (edge_socket.MAX_LINE + 10) + end)
    await writer.drain()
    got = json.loads(await asyncio.wait_for(reader.readline(), 10))
    assert got["status"] == 400 and got["body"]["error"]["code"] == "body_too_large"
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the sidecar
    writer.close()


async def test_a_closed_connection_cancels_its_queued_ask(edge: Any, redis: Any) -> None:
    client, path = edge
    tickets = []
    for _ in range(4):  # max_inflight 4: the fifth waits in the queue
        a = (await ask(path, json.dumps(admit_body(max_tokens=10)).encode()))[0]
        assert a["status"] == 200, a
        tickets.append(a["body"]["ticket"])
    _reader, writer = await asyncio.open_unix_connection(path)
    writer.write(json.dumps(admit_body(max_tokens=10)).encode() + b"\n")
    await writer.drain()
    await asyncio.sleep(0.4)
    assert (await (await client.get("/healthz")).json())["queued"] == 1
    writer.close()  # NGINX aborted the request: the client went away
    await asyncio.sleep(0.3)
    assert (await (await client.get("/healthz")).json())["queued"] == 0
    await client.post("/release", json={"ticket": tickets[0], "status": 200, "usage": None})
    a = (await ask(path, json.dumps(admit_body(max_tokens=10)).encode()))[0]
    assert a["status"] == 200  # the freed slot went to a live ask, not to the one that left
    assert await redis.zcard(keys.node_leases("n1")) == 4


@pytest.mark.parametrize("acked", [False, True])
async def test_an_answer_the_edge_never_read_gives_its_lease_back(
    edge: Any, redis: Any, acked: bool
) -> None:
    """NGINX aborted the request (the client left) after the sidecar wrote its admission: no
    release will ever come. The edge acknowledges each answer it reads (`+`); a connection that
    closes before that gives the lease back now instead of holding it for lease_ttl_s."""
    _client, path = edge
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(json.dumps(admit_body(ack=True)).encode() + b"\n")
    await writer.drain()
    answer = json.loads(await asyncio.wait_for(reader.readline(), 10))
    assert answer["status"] == 200
    assert await redis.zcard(keys.node_leases("n1")) == 1
    if acked:
        writer.write(b"+\n")
        await writer.drain()
        await asyncio.sleep(0.05)
    writer.close()
    await asyncio.sleep(0.3)
    assert await redis.zcard(keys.node_leases("n1")) == (1 if acked else 0)


async def test_a_reasked_request_gives_back_the_lease_its_lost_sidecar_took(
    redis: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    """A sidecar leased node n1 for a request and died before the edge read the answer; the
    edge asks another sidecar again (same request id, `reask`), which places it on n2: the lease
    on n1 goes back at once (no release would ever come for it)."""
    path = tmp_path / "policies.yaml"
    two = BASE_POLICY.replace(
        "nodes:\n",
        "nodes:\n  n2: {url: 'http://127.0.0.1:2', models: [m], memory_source: kv, max_inflight: 4}\n",
    )
    path.write_text(two.replace("REDIS_URL", redis_server.url))
    holder = PolicyHolder(path, load_policy(path), Metrics())
    await set_node(redis, "n1")
    await set_node(redis, "n2", state="drain")
    client = TestClient(TestServer(build_app(holder)))
    await client.start_server()
    try:
        rid = "r" * 32
        first = await (await client.post("/admit", json=admit_body(request_id=rid))).json()
        assert first["node"] == "n1"
        await set_node(redis, "n1", state="drain")  # the request now fits only n2
        await set_node(redis, "n2")
        await asyncio.sleep(0.3)
        body = admit_body(request_id=rid, reask=True)
        again = await (await client.post("/admit", json=body)).json()
        assert again["node"] == "n2", again
        assert await redis.zcard(keys.node_leases("n1")) == 0
        assert await redis.zscore(keys.node_leases("n2"), again["ticket"]) is not None
    finally:
        await client.close()
