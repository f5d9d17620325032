"""Nodes that register themselves: the agent's side (register, heartbeat, leave) and the
sidecar's (`Membership`: which registrations to believe).

A registration is the node's spec, as a `nodes:` entry would say it (url, models, pool,
max_inflight, …), signed with the shared secret of `discovery.secret_file` (HMAC-SHA256), in
one Redis hash; a counter moves with every change, so that sidecars read the hash only when it
did; each agent's heartbeat is its node's score in a sorted set. A sidecar believes a
registration only when its signature holds, its spec passes the same checks as a listed node,
its URLs lie in `discovery.allow`, and its agent was heard within `forget_after_s`; it then
becomes a node of the running policy (reload.PolicyHolder), routed, drained and reported like
any other. Liveness is the agent's state key as for every node: a registered node whose agent
falls silent is down at `stale_after_s`, and forgotten at `forget_after_s`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from admission.policy import Node, Policy
from admission.policy.nodes import registered_node
from admission.store import keys

log = logging.getLogger(__name__)

SECRET_ENV = "ADMISSION_DISCOVERY_SECRET"  # overrides discovery.secret_file (a Kubernetes Secret)
POLL_S = 1.0  # how often a sidecar looks at the registry's version (one GET)
ALIVE_EVERY_S = 5.0  # ... and reads the heartbeats, to forget the silent


def read_secret(policy: Policy) -> bytes | None:
    """The registration secret: $ADMISSION_DISCOVERY_SECRET, else discovery.secret_file's first
    line; None (nothing believed, nothing signed) when neither gives 16 characters or more."""
    value = os.environ.get(SECRET_ENV)
    if value is None and policy.discovery.secret_file:
        try:
            value = Path(policy.discovery.secret_file).read_text().strip()
        except OSError as exc:
            log.error("discovery: cannot read the secret file: %s", exc.strerror)
            return None
    if value is None or len(value) < 16:
        return None
    return value.encode()


def spec_of(node: Node) -> dict[str, Any]:
    """A node's registration spec: its `nodes:` entry, without the id."""
    spec: dict[str, Any] = {
        "url": node.url,
        "models": list(node.models),
        "memory_source": node.memory_source.value,
        "max_inflight": node.max_inflight,
        "gpus": list(node.gpus),
    }
    for name in ("kv_pool_bytes", "device_url", "pool"):
        if getattr(node, name) is not None:
            spec[name] = getattr(node, name)
    return spec


def _mac(secret: bytes, nid: str, spec: dict[str, Any]) -> str:
    text = json.dumps({"id": nid, "spec": spec}, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def signed(secret: bytes, nid: str, spec: dict[str, Any]) -> str:
    return json.dumps({"spec": spec, "mac": _mac(secret, nid, spec)}, sort_keys=True)


# -- the agent's side ----------------------------------------------------------------------------
async def register(redis: Any, secret: bytes, nid: str, spec: dict[str, Any]) -> None:
    """Write (or rewrite) the node's signed spec, mark it heard now, move the version."""
    pipe = redis.pipeline(transaction=False)
    pipe.hset(keys.REGISTRY, nid, signed(secret, nid, spec))
    pipe.zadd(keys.REGISTRY_ALIVE, {nid: int(time.time() * 1000)})
    pipe.incr(keys.REGISTRY_VERSION)
    await pipe.execute()


def heartbeat(pipe: Any, node_id: str) -> None:
    """Queued in the agent's tick: its node was heard now."""
    pipe.zadd(keys.REGISTRY_ALIVE, {node_id: int(time.time() * 1000)})


async def deregister(redis: Any, node_id: str) -> None:
    pipe = redis.pipeline(transaction=False)
    pipe.hdel(keys.REGISTRY, node_id)
    pipe.zrem(keys.REGISTRY_ALIVE, node_id)
    pipe.incr(keys.REGISTRY_VERSION)
    await pipe.execute()


# -- the sidecar's side --------------------------------------------------------------------------
class Membership:
    """Reads the registry and hands the nodes it believes to `apply` (PolicyHolder's
    `set_registered`) whenever they change. `policy`: the file's policy (discovery settings,
    the listed nodes and pools a registration must not clash with)."""

    def __init__(
        self,
        redis: Any,
        policy: Callable[[], Policy],
        apply: Callable[[dict[str, Node]], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.policy = policy
        self.apply = apply
        self.clock = clock
        self._version: Any = None
        self._raw: dict[str, str] = {}
        self._alive_at = 0.0
        self._alive: set[str] = set()
        self._refused: dict[str, str] = {}  # node → why, logged once per reason
        # Each registration checked once (signature, spec) per policy and secret, not per look:
        # node → (its raw registration, the node or None, why not).
        self._checked: dict[str, tuple[str, Node | None, str]] = {}
        self._checked_for: tuple[Policy, bytes | None] | None = None

    async def step(self) -> None:
        """One look: the version; the specs when it moved; the heartbeats every ALIVE_EVERY_S."""
        policy = self.policy()
        if not policy.discovery.enabled:
            self.apply({})
            return
        now = self.clock()
        version = await self.redis.get(keys.REGISTRY_VERSION)
        moved = version != self._version
        if moved:
            raw = await self.redis.hgetall(keys.REGISTRY)
            self._raw = {_s(k): _s(v) for k, v in raw.items()}
            self._version = version
        if moved or now - self._alive_at >= ALIVE_EVERY_S:
            since = int((now - policy.discovery.forget_after_s) * 1000)
            heard = await self.redis.zrangebyscore(keys.REGISTRY_ALIVE, since, "+inf")
            self._alive, self._alive_at = {_s(n) for n in heard}, now
        self.apply(self.believed(policy, read_secret(policy)))

    def believed(self, policy: Policy, secret: bytes | None) -> dict[str, Node]:
        out: dict[str, Node] = {}
        cached = self._checked_for
        if cached is None or cached[0] is not policy or cached[1] != secret:
            self._checked, self._checked_for = {}, (policy, secret)
        for gone in self._checked.keys() - self._raw.keys():
            del self._checked[gone]
        for nid in sorted(self._raw):
            raw = self._raw[nid]
            hit = self._checked.get(nid)
            if hit is None or hit[0] != raw:
                hit = (raw, *self._check(policy, secret, nid, raw))
                self._checked[nid] = hit
            node, why = hit[1], hit[2]
            if node is None:
                if self._refused.get(nid) != why:
                    self._refused[nid] = why
                    log.warning("discovery: registration of node %s refused: %s", nid, why)
                continue
            self._refused.pop(nid, None)
            if nid in self._alive and len(out) < policy.discovery.max_nodes:
                out[nid] = node
        return out

    @staticmethod
    def _check(policy: Policy, secret: bytes | None, nid: str, raw: str) -> tuple[Node | None, str]:
        if secret is None:
            return None, "this sidecar has no discovery secret (discovery.secret_file)"
        try:
            doc = json.loads(raw)
            spec, mac = doc["spec"], doc["mac"]
        except (ValueError, KeyError, TypeError):
            return None, "not a registration"
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(secret, nid, spec)):
            return None, "not signed with the discovery secret"
        return registered_node(policy, nid, spec)

    async def run(self) -> None:
        """Look every POLL_S until cancelled; Redis failing is logged and tried again."""
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("discovery: registry not read (%s); keeping the nodes known", exc)
            await asyncio.sleep(POLL_S)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
