from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from admission.policy import Policy, parse_policy
from devstack.procs import RedisServer
from devstack.stack import DEFAULT_POLICY, Stack

ROOT = Path(__file__).resolve().parent.parent

BASE_POLICY = """
version: 1
redis: {url: "REDIS_URL", command_timeout_ms: 200, connect_timeout_ms: 200}
watermarks: {hold: 0.8, drain: 0.85, reopen: 0.75, stale_after_s: 2}
classes:
  realtime: {weight: 8, min_share: 0.1, priority: 0, deadline_s: 5}
  batch: {weight: 3, min_share: 0.1, priority: 1, deadline_s: 10, promote_after_s: 2}
  offline: {weight: 1, min_share: 0.05, priority: 2, deadline_s: 20, promote_after_s: 4}
tenants:
  acme:
    weight: 5
    keys: ["plain:sk-acme"]
    classes: [realtime, batch]
    limits: {requests_per_s: 10, request_burst: 10, tokens_per_min: 60000, token_burst: 5000}
  small:
    weight: 1
    keys: ["plain:sk-small"]
    classes: [realtime]
    limits: {requests_per_s: 1, request_burst: 2, tokens_per_min: 600, token_burst: 300}
nodes:
  n1: {url: "http://127.0.0.1:1", models: [m], memory_source: kv, max_inflight: 4}
"""


def started(
    factory: pytest.TempPathFactory, name: str, supervised: bool = False, **kw: Any
) -> Iterator[Stack]:
    """A stack on the shipped policy for a module's tests (`yield from` it in the module's
    fixture), stopped whatever happens; `supervised`: dead children restarted as `admission
    up` does (Stack.running); `kw`: Stack's (nodes, sidecars, overrides...)."""
    s = Stack(DEFAULT_POLICY, factory.mktemp(name), **kw)
    if supervised:
        with s.running():
            yield s
        return
    try:
        s.start()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Any]:
    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushall()
    yield client
    await client.aclose()


def make_policy(redis_url: str, text: str = BASE_POLICY) -> Policy:
    return parse_policy(text.replace("REDIS_URL", redis_url))


@pytest.fixture
def policy(redis_server: RedisServer) -> Policy:
    return make_policy(redis_server.url)


@pytest.fixture(autouse=True)
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves asyncio tasks running (kopf's habit)."""
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() - before if not t.done() and "pytest" not in repr(t)]
    leaked = [t for t in leaked if t is not asyncio.current_task()]
    assert not leaked, f"tasks left running: {leaked}"
