"""The edge's admission socket (admission.edge_socket): one JSON line each way, the same answers
as /admit, and a connection that closes while its ask waits frees its queue slot."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from admission import edge_socket
from admission.store import keys
from tests.test_server import admit_body, sidecar  # noqa: F401 (fixture)


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
        path, json.dumps(admit_body()).encode(), json.dumps(admit_body(tenant="nobody")).encode(),
        b"{not json", json.dumps(admit_body(color="red")).encode(),
    )  # fmt: skip
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
