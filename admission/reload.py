"""Policy hot reload: build and validate the new policy completely, then swap one reference.

Triggers: a change of the file (watchfiles, which sees editors' rename-over-write too) and
SIGHUP. An invalid file leaves the running policy in force; its problems are logged one per
line and counted in `admission_policy_reloads_total{result="invalid"}`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Collection
from pathlib import Path

from admission import cache_salt
from admission.errors import PolicyError
from admission.metrics import Metrics
from admission.policy import Node, Policy, load_policy
from admission.scheduling.priority import BANDS

log = logging.getLogger(__name__)


def _digest(path: Path) -> str:
    """The policy version shown on the status page: SHA-256 of the file, 12 hex digits."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    except OSError:
        return "unknown"


def watched_dirs(path: Path) -> list[Path]:
    """The directories whose changes can change the policy: the one the path names, and the
    target's when the path is a symlink into another directory. A Kubernetes ConfigMap volume
    is the first kind: `policies.yaml` → `..data/policies.yaml`, and an update swaps the
    `..data` link to a new timestamped directory and deletes the old one, so the resolved
    directory is never the one to watch there."""
    named = path.absolute().parent
    target = path.resolve().parent
    if target == named or target.is_relative_to(named):
        return [named]
    return [named, target]


def policy_filter(path: Path) -> Callable[[object, str], bool]:
    """Events that may have changed the policy (the directories may be busy: logs, Redis AOF next
    to a local stack's policy): the file itself, its symlink's target, or the `..data` swap of a
    ConfigMap volume. A name compare first, resolve() only for the rest."""
    name, target = path.name, path.resolve()

    def wanted(_change: object, changed: str) -> bool:
        base = Path(changed).name
        if base in ("..data", name):
            return True
        return changed.endswith(target.name) and Path(changed).resolve() == target

    return wanted


class PolicyHolder:
    """The running policy, swapped atomically; listeners run after each successful swap. The
    running policy is the file's (`file_policy`) with the nodes that registered themselves
    (`set_registered`, nodes/registry.py) among its nodes."""

    def __init__(self, path: Path, policy: Policy, metrics: Metrics) -> None:
        self.path = path
        self.current = self.file_policy = policy
        self.registered: dict[str, Node] = {}
        self.metrics = metrics
        self.listeners: list[Callable[[Policy], None]] = []
        self.version, self.loaded_at = _digest(path), time.time()
        self.rejected = False  # the file on disk failed its last reload (the alert's gauge)
        metrics.policy_loaded.set(self.loaded_at)

    def __call__(self) -> Policy:
        return self.current

    def reload(self) -> bool:
        """Load, validate and swap; False (the running policy stays) on any problem."""
        try:
            new = load_policy(self.path)
        except PolicyError as exc:
            self.metrics.policy_reloads.labels("invalid").inc()
            self.metrics.policy_rejected.set(1)
            self.rejected = True
            log.error(
                "policy %s rejected, keeping the running policy (version %s):",
                self.path,
                self.version,
            )
            for problem in exc.problems:
                log.error("  %s", problem)
            return False
        if self.rejected:
            self.rejected = False
            self.metrics.policy_rejected.set(0)
            log.warning("policy %s valid again (version %s)", self.path, _digest(self.path))
        self.file_policy = new
        if not self._swap():
            return True
        self.metrics.policy_reloads.labels("ok").inc()
        self.version, self.loaded_at = _digest(self.path), time.time()
        self.metrics.policy_loaded.set(self.loaded_at)
        log.info("policy %s reloaded: version %s", self.path, self.version)
        return True

    def set_registered(self, nodes: dict[str, Node]) -> None:
        """The registered nodes the sidecar believes now; the policy swaps if they changed."""
        if nodes == self.registered:
            return
        joined = sorted(set(nodes) - set(self.registered))
        left = sorted(set(self.registered) - set(nodes))
        self.registered = nodes
        if self._swap():
            log.warning(
                "discovery: %d registered node(s)%s%s",
                len(nodes),
                f"; joined: {', '.join(joined)}" if joined else "",
                f"; left: {', '.join(left)}" if left else "",
            )

    def _swap(self) -> bool:
        """Make the file's policy with the registered nodes the running one; whether it moved."""
        new = self.file_policy
        extra = {k: v for k, v in self.registered.items() if k not in new.nodes}
        if extra:
            new = dataclasses.replace(new, nodes={**new.nodes, **extra})
        if new == self.current:
            return False
        self.current = new
        for listener in self.listeners:
            try:
                listener(new)
            except Exception:
                # One listener failing (the edge table's disk full) must not leave the others
                # (the dispatcher) on the old policy, nor stop the watcher: log and go on.
                self.metrics.policy_reloads.labels("listener_error").inc()
                log.exception("policy listener %r failed; the others have the new policy", listener)
        return True

    async def watch(self) -> None:
        """Reload on file change and on SIGHUP, until cancelled."""
        from watchfiles import awatch

        loop = asyncio.get_running_loop()
        hup = asyncio.Event()
        try:
            loop.add_signal_handler(signal.SIGHUP, hup.set)
        except (RuntimeError, ValueError):  # not the main thread (tests): file watching only
            pass

        async def on_hup() -> None:
            while True:
                await hup.wait()
                hup.clear()
                log.info("SIGHUP: reloading policy")
                try:
                    self.reload()
                except Exception:
                    log.exception("policy reload failed; keeping the running policy")

        hup_task = asyncio.create_task(on_hup())
        try:
            async for _changes in awatch(
                *watched_dirs(self.path),
                watch_filter=policy_filter(self.path),
                debounce=200,
                step=50,
                recursive=False,
            ):
                try:
                    self.reload()
                except Exception:  # the watcher must outlive any one bad reload
                    self.metrics.policy_reloads.labels("invalid").inc()
                    log.exception("policy reload failed; keeping the running policy")
        finally:
            hup_task.cancel()
            try:
                loop.remove_signal_handler(signal.SIGHUP)
            except (RuntimeError, ValueError):
                pass


def edge_table(
    policy: Policy, unusable: Collection[str] = (), secret: bytes | None = None
) -> dict[str, object]:
    """What the NGINX edge needs from the policy: key digests → tenant, classes, models, limits,
    the tenant's cache salt (`secret`: the sidecars' shared one; None: no salts yet); and each
    node's URL, models and whether it takes new work (`unusable`: down, draining or in
    maintenance when last seen), for the edge's fail-open mode."""
    served = sorted(policy.models())
    salted = cache_salt.salts(policy, secret)
    return {
        "keys": dict(policy.key_index),
        "tenants": {
            t.id: {
                "classes": list(t.classes),
                "default_class": t.default_class,
                "models": list(t.models) or served,
                **({"salt": salted[t.id]} if t.id in salted else {}),
            }
            for t in policy.tenants.values()
        },
        "classes": {c.name: c.priority for c in policy.classes.values()},
        # Fail-open's engine priority: the class's, in its cold band (scheduling/priority.py).
        "engine_priority": {
            c.name: c.priority * BANDS + BANDS - 1 for c in policy.classes.values()
        },
        "deadline_s": {c.name: c.deadline_s for c in policy.classes.values()},
        "max_body_bytes": policy.edge.max_body_bytes,
        "chars_per_token": policy.edge.chars_per_token,
        "default_max_tokens": policy.edge.default_max_tokens,
        "lease_ttl_s": policy.queue.lease_ttl_s,
        "sidecar_failure_mode": policy.edge.sidecar_failure_mode,
        "admit_embeddings": policy.edge.admit_embeddings,
        # Path → upstream; the edge passes the longest matching path after the key check.
        "passthrough": dict(policy.edge.passthrough),
        "nodes": {
            n.id: {"url": n.url, "models": list(n.models), "serving": n.id not in unusable}
            for n in policy.nodes.values()
        },
    }


def write_edge_table(
    policy: Policy, path: Path, unusable: Collection[str] = (), secret: bytes | None = None
) -> None:
    """Atomically replace the edge's table (the edge re-reads it once a second)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(edge_table(policy, unusable, secret), sort_keys=True))
    tmp.replace(path)
