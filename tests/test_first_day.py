"""What clients and load balancers see when no node can serve (issue 63): the operator drains
the only node of a real stack (NGINX + ngx_lua, Redis, two sidecars, an agent, one emulated
vLLM node)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from devstack.stack import Stack
from tests.conftest import started

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from started(tmp_path_factory, "firstday", nodes=1)


def get(url: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    data = json.dumps(body).encode() if body is not None else None
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=h, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, json.load(r)
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers, json.load(e)


def maintenance(stack: Stack, on: bool) -> None:
    auth = {"Authorization": f"Bearer {stack.admin_token}"}
    action = "drain" if on else "undrain"
    status, _h, _b = get(f"{stack.sidecar_url}/nodes/node-0/{action}", {}, auth)
    assert status == 200


def chat(stack: Stack, cls: str) -> tuple[int, Any, Any]:
    body = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"Authorization": "Bearer sk-demo-acme", "X-Request-Class": cls}
    return get(f"{stack.url}/v1/chat/completions", body, headers)


def test_no_node_to_serve_is_503_no_capacity_not_429(stack: Stack) -> None:
    assert chat(stack, "realtime")[0] == 200
    assert get(f"{stack.url}/healthz")[::2] == (200, {"status": "ok"})
    maintenance(stack, True)
    try:
        time.sleep(0.6)  # both sidecars' next refresh sees the flag
        status, headers, body = get(f"{stack.url}/healthz")
        assert (status, body) == (503, {"status": "no_capacity"})  # not ready
        assert get(f"{stack.url}/livez")[::2] == (200, {"status": "alive"})  # NGINX lives
        for cls in ("realtime", "batch"):
            status, headers, body = chat(stack, cls)
            assert status == 503, (cls, body)
            assert body["error"]["code"] == "no_capacity", body
            assert int(headers["Retry-After"]) >= 10
            # The tenant's buckets as they are: it was not rate limited.
            assert int(headers["x-ratelimit-remaining-requests"]) > 0
    finally:
        maintenance(stack, False)
    time.sleep(0.6)
    assert chat(stack, "realtime")[0] == 200
    assert get(f"{stack.url}/healthz")[::2] == (200, {"status": "ok"})
