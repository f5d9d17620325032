"""Nodes that join and leave by themselves (issue 65), on a real stack (NGINX + ngx_lua, Redis,
two sidecars, the stack's agent and node): `admission agent --register` brings a new emulated
node into every sidecar's views under load; SIGTERM to that agent drains it, waits for its
requests and deregisters it, losing none; a registration without the secret, or naming a URL
outside `discovery.allow`, is refused and logged; a fresh sidecar finds the registered nodes in
Redis."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis

from admission.metrics import Metrics
from admission.nodes import registry
from admission.policy import load_policy
from admission.policy.nodes import registered_node
from admission.reload import PolicyHolder
from admission.store import keys
from devstack.nodes import NodeSet
from devstack.procs import stop_process, wait_for
from devstack.stack import DEFAULT_POLICY, Stack

pytestmark = pytest.mark.timeout(240)
SECRET = "registration-secret-for-tests-0123456789"
ADMISSION = str(Path(sys.executable).with_name("admission"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("discovery")
    secret = work / "discovery.secret"
    secret.write_text(SECRET + "\n")
    discovery = {"enabled": True, "allow": ["127.0.0.0/8"], "secret_file": str(secret)}
    s = Stack(DEFAULT_POLICY, work / "stack", nodes=1, policy_overrides={"discovery": discovery})
    try:
        s.start()
        yield s
    finally:
        s.stop()


def views(stack: Stack) -> dict[str, str]:
    with urllib.request.urlopen(f"{stack.sidecar_url}/nodes", timeout=5) as r:
        return {n["node"]: n["state"] for n in json.load(r)["nodes"]}


def chat(stack: Stack) -> int:
    body = {
        "model": "llama-3-8b",
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "hi"}],
    }
    req = urllib.request.Request(
        f"{stack.url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer sk-demo-acme", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        with e:
            return e.code


def served(port: int) -> float:
    """Requests the node on `port` finished (the emulator's vllm:request_success)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(x.split()[-1]) for x in text.splitlines() if x.startswith("vllm:request_success")
    )


class Load:
    """Chat requests from 6 threads until stopped; every status kept."""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.statuses, self.stop = stack, [], threading.Event()
        self.threads = [threading.Thread(target=self.run) for _ in range(6)]
        for t in self.threads:
            t.start()

    def run(self) -> None:
        while not self.stop.is_set():
            self.statuses.append(chat(self.stack))

    def end(self) -> list[int]:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)
        return self.statuses


def register_agent(stack: Stack, port: int, node_id: str, run: Path) -> subprocess.Popen[bytes]:
    url = f"http://127.0.0.1:{port}"
    with open(run / f"agent-{node_id}.log", "ab") as log:
        return subprocess.Popen(
            [
                *(ADMISSION, "agent", "--policy", str(stack.runtime_policy), "--register"),
                *("--node-id", node_id, "--url", url, "--models", "llama-3-8b"),
                *("--max-inflight", "16", "--device-url", f"{url}/sim/device", "--grace-s", "60"),
            ],
            stdout=log,
            stderr=log,
        )


def test_a_node_registered_under_load_takes_traffic_and_leaves_on_sigterm_losing_nothing(
    stack: Stack,
) -> None:
    run = stack.run_dir
    extra = NodeSet(1, run)
    agent = None
    load = Load(stack)
    try:
        time.sleep(2)
        assert "node-x" not in views(stack)
        agent = register_agent(stack, extra.ports[0], "node-x", run)
        started = time.monotonic()
        wait_for(lambda: views(stack).get("node-x") == "open", 15, "node-x in the views", agent)
        joined_s = time.monotonic() - started
        assert joined_s < 5, joined_s  # the stated time: the agent's first sample + 1 s
        wait_for(lambda: served(extra.ports[0]) >= 5, 30, "node-x serving", agent)
        # Graceful leave: SIGTERM drains it (every sidecar routes nothing new there), waits for
        # its requests, deregisters.
        agent.send_signal(signal.SIGTERM)
        wait_for(lambda: views(stack).get("node-x") == "maintenance", 5, "drain seen", None)
        time.sleep(0.5)  # every sidecar's next refresh has seen the drain
        after_drain = served(extra.ports[0]) + _inflight(stack, "node-x")
        assert agent.wait(timeout=90) == 0
        wait_for(lambda: "node-x" not in views(stack), 5, "node-x gone from the views", None)
        time.sleep(2)
        assert served(extra.ports[0]) <= after_drain  # nothing routed there after the drain
        statuses = load.end()
    finally:
        load.end()
        if agent is not None:
            stop_process(agent)
        extra.stop()
    assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    r = sync_redis.Redis.from_url(stack.redis_url)
    assert (
        r.hget(keys.REGISTRY, "node-x") is None and r.zscore(keys.REGISTRY_ALIVE, "node-x") is None
    )
    log = "".join((run / f"sidecar-{i}.log").read_text() for i in range(2))
    assert SECRET not in log


def _inflight(stack: Stack, node: str) -> int:
    with urllib.request.urlopen(f"{stack.sidecar_url}/nodes", timeout=5) as r:
        return sum(n["inflight"] for n in json.load(r)["nodes"] if n["node"] == node)


def test_a_registration_unsigned_or_outside_the_allowed_networks_is_refused_and_logged(
    stack: Stack,
) -> None:
    r = sync_redis.Redis.from_url(stack.redis_url)
    policy = load_policy(stack.runtime_policy)
    rogue = {"url": "http://127.0.0.1:9", "models": ["llama-3-8b"]}
    forged = json.dumps({"spec": rogue, "mac": "0" * 64})
    near, _why = registered_node(policy, "node-far", rogue)
    assert near is not None
    elsewhere = registry.spec_of(near)
    elsewhere["url"] = "http://10.9.8.7:8000"  # signed with the secret, but outside allow
    mac = registry._mac(SECRET.encode(), "node-far", elsewhere)
    r.hset(
        keys.REGISTRY,
        mapping={"node-rogue": forged, "node-far": json.dumps({"spec": elsewhere, "mac": mac})},
    )
    now = int(time.time() * 1000)
    r.zadd(keys.REGISTRY_ALIVE, {"node-rogue": now, "node-far": now})
    r.incr(keys.REGISTRY_VERSION)
    try:
        time.sleep(2.5)
        got = views(stack)
        assert "node-rogue" not in got and "node-far" not in got
        log = "".join((stack.run_dir / f"sidecar-{i}.log").read_text() for i in range(2))
        assert (
            "registration of node node-rogue refused: not signed with the discovery secret" in log
        )
        assert "registration of node node-far refused: http://10.9.8.7:8000 is outside" in log
        assert SECRET not in log
    finally:
        r.hdel(keys.REGISTRY, "node-rogue", "node-far")
        r.zrem(keys.REGISTRY_ALIVE, "node-rogue", "node-far")
        r.incr(keys.REGISTRY_VERSION)


def test_a_fresh_sidecar_finds_the_registered_nodes_in_redis(stack: Stack) -> None:
    """Membership lives in Redis: a sidecar started now (a restart) believes what is there."""
    policy = load_policy(stack.runtime_policy)
    node, why = registered_node(
        policy, "node-y", {"url": "http://127.0.0.1:7", "models": ["llama-3-8b"]}
    )
    assert node is not None, why

    async def go() -> dict[str, Any]:
        client = sync_redis.asyncio.Redis.from_url(stack.redis_url)
        await registry.register(client, SECRET.encode(), node.id, registry.spec_of(node))
        try:
            holder = PolicyHolder(stack.runtime_policy, policy, Metrics())
            members = registry.Membership(client, lambda: holder.file_policy, holder.set_registered)
            await members.step()
            return dict(holder.current.nodes)
        finally:
            await registry.deregister(client, "node-y")
            await client.aclose()

    nodes = asyncio.run(go())
    assert nodes["node-y"] == node and "node-0" in nodes


def test_discovery_defaults_fill_what_a_registration_leaves_out(tmp_path: Path) -> None:
    """`discovery.defaults`: per model, then "*", for the keys a registering agent was not
    given; what it was given wins; a bad default is a policy problem with its path; `check
    --diff` says what a change means."""
    import argparse

    import yaml

    from admission.errors import PolicyError
    from admission.processes import _registration

    secret = tmp_path / "s"
    secret.write_text(SECRET)
    raw = yaml.safe_load(DEFAULT_POLICY.read_text())
    raw["discovery"] = {
        "enabled": True,
        "allow": ["127.0.0.0/8"],
        "secret_file": str(secret),
        "defaults": {"*": {"max_inflight": 16}, "llama-3-8b": {"memory_source": "kv"}},
    }
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump(raw))
    policy = load_policy(new)
    spec = {"url": "http://127.0.0.1:8000", "models": ["llama-3-8b"]}
    node, why = registered_node(policy, "gpu-7", spec)
    assert node is not None, why
    assert (node.max_inflight, node.memory_source.value) == (16, "kv")
    node, _ = registered_node(policy, "gpu-7", {**spec, "max_inflight": 4})
    assert node is not None and node.max_inflight == 4
    # The agent signs only what it was given: the sidecars' defaults apply.
    args = argparse.Namespace(
        node_id="gpu-7",
        url=spec["url"],
        models="llama-3-8b",
        max_inflight=None,
        memory_source=None,
        pool=None,
        device_url=None,
    )
    node, _key, signed_spec = _registration(args, policy)
    assert signed_spec == spec and node.max_inflight == 16
    # A default a listed node could not have is refused, with its path.
    raw["discovery"]["defaults"]["*"]["max_inflight"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(PolicyError) as err:
        load_policy(bad)
    assert any(p.startswith("discovery.defaults.*") for p in err.value.problems), err.value
    # check --diff
    raw["discovery"]["defaults"]["*"]["max_inflight"] = 32
    bad.write_text(yaml.safe_dump(raw))
    out = subprocess.run(
        [sys.executable, "-m", "admission.cli", "check", "--diff", str(new), str(bad)],
        capture_output=True,
        text=True,
    )
    assert "registered nodes of every model that do not say their max_inflight take 32" in (
        out.stdout
    ), out.stdout + out.stderr
