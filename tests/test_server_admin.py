"""The sidecar's admin side: node drains over the admin port, who may call what (the edge's
calls, node admin, a public port), and /healthz telling the truth (the sidecar of
tests/test_server.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from admission.metrics import Metrics
from admission.policy import load_policy
from admission.reload import PolicyHolder
from admission.server import DISPATCH_TASK, build_app
from admission.trust import Access
from devstack.procs import RedisServer
from tests.conftest import BASE_POLICY
from tests.test_server import admit_body, set_node, sidecar

__all__ = ["sidecar"]  # the fixture
ADMIN_TOKEN = "admin-token-for-tests-0123456789"


@pytest.fixture
async def locked_sidecar(
    redis: Any, redis_server: RedisServer, tmp_path: Path
) -> AsyncIterator[TestClient[Any, Any]]:
    """A sidecar with the trust model `serve` uses: edge calls on the unix socket only, node
    admin over TCP only with the admin token."""
    path = tmp_path / "policies.yaml"
    path.write_text(BASE_POLICY.replace("REDIS_URL", redis_server.url))
    holder = PolicyHolder(path, load_policy(path), Metrics())
    await set_node(redis, "n1")
    app = build_app(holder, access=Access(admin_token=ADMIN_TOKEN))
    client = TestClient(TestServer(app))
    await client.start_server()
    yield client
    await client.close()


async def test_operator_drain_and_undrain(locked_sidecar: Any) -> None:
    client = locked_sidecar
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    r = await client.post("/nodes/n1/drain", headers=auth)
    assert r.status == 200
    nodes = (await (await client.get("/nodes")).json())["nodes"]
    assert nodes[0]["state"] == "maintenance"
    await client.post("/nodes/n1/undrain", headers=auth)
    nodes = (await (await client.get("/nodes")).json())["nodes"]
    assert nodes[0]["state"] == "open"
    assert (await client.post("/nodes/zz/drain", headers=auth)).status == 404


async def test_node_admin_and_edge_calls_need_their_credentials(locked_sidecar: Any) -> None:
    client = locked_sidecar
    for headers in (
        {},
        {"Authorization": "Bearer wrong-token-0123456789"},
        {"Authorization": ADMIN_TOKEN},
    ):
        r = await client.post("/nodes/n1/drain", headers=headers)
        assert r.status == 401, headers
        assert (await r.json())["error"]["code"] == "invalid_admin_token"
        assert ADMIN_TOKEN not in await r.text()
    nodes = (await (await client.get("/nodes")).json())["nodes"]
    assert nodes[0]["state"] == "open"  # nothing changed
    # The edge's calls are refused over TCP: any local process could claim any tenant.
    r = await client.post("/admit", json=admit_body())
    assert r.status == 403 and (await r.json())["error"]["code"] == "edge_only"
    r = await client.post("/release", json={"ticket": "x"})
    assert r.status == 403


async def test_node_admin_over_tcp_without_a_token_is_refused(sidecar: Any) -> None:
    client, _h, _p = sidecar
    r = await client.post("/nodes/n1/drain")
    assert r.status == 403
    assert (await r.json())["error"]["code"] == "admin_token_not_configured"


async def test_healthz_tells_the_truth(sidecar: Any) -> None:
    client, _h, _p = sidecar
    full = await (await client.get("/healthz")).json()
    assert full["status"] == "ok" and "n1" in full["nodes"]
    assert await (await client.get("/healthz?brief=1")).json() == {"status": "ok"}
    task = client.server.app[DISPATCH_TASK]
    task.cancel()  # a dispatcher that stopped: queued requests would only time out
    with pytest.raises(asyncio.CancelledError):
        await task
    r = await client.get("/healthz")
    assert r.status == 503 and (await r.json())["status"] == "dispatcher_stopped"


@pytest.mark.parametrize("extra", [[], ["--admin-token-file", "/nonexistent/token"]])
def test_serve_refuses_a_public_admin_port_without_a_token(
    tmp_path: Path, extra: list[str]
) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(BASE_POLICY.replace("REDIS_URL", "redis://127.0.0.1:1/0"))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "admission.cli",
            "serve",
            "--policy",
            str(path),
            "--host",
            "0.0.0.0",
            "--port",
            "1",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert "admin" in r.stderr
