"""Nodes in the policy: the listed ones (`nodes:`), and the rules for the ones that register
themselves (`discovery:`): which URLs a registration may name, the secret it must carry, how
long a silent one is remembered. A registration's spec is checked by the same parser as a
listed node (`registered_node`), so a registered node is a policy node like any other."""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from admission.policy.checks import Checker, is_id
from admission.policy.model import Discovery, MemorySource, Node, Policy

_NODE_KEYS = {
    "url",
    "models",
    "memory_source",
    "max_inflight",
    "kv_pool_bytes",
    "gpus",
    "device_url",
    "pool",
}


def parse_nodes(c: Checker, raw: Any) -> dict[str, Node]:
    """`nodes:`, each entry checked (and a registration's spec, by `registered_node`)."""
    m = c.mapping(raw, "nodes", None)
    if m is None:
        return {}
    out: dict[str, Node] = {}
    urls: dict[str, str] = {}
    for nid, body in m.items():
        p = f"nodes.{nid}"
        if not is_id(nid):
            c.err(p, "node id must be letters, digits, '-', '_' or '.'")
        b = c.mapping(body, p, _NODE_KEYS, required={"url", "models"}) or {}
        url = c.string(b, "url", p, "", prefixes=("http://", "https://")).rstrip("/")
        if url and url in urls:
            c.err(f"{p}.url", f"same URL as node {urls[url]}")
        urls[url] = str(nid)
        models = tuple(c.string_list(b, "models", p, []))
        if not models:
            c.err(f"{p}.models", "must list at least one model")
        gpus = b.get("gpus", [0])
        if not isinstance(gpus, list) or not all(_gpu_ref(g) for g in gpus):
            c.err(
                f"{p}.gpus", "must be a list of NVML device indices (>= 0) or UUIDs (GPU-…, MIG-…)"
            )
            gpus = [0]
        kv = b.get("kv_pool_bytes")
        out[str(nid)] = Node(
            id=str(nid),
            url=url,
            models=models,
            memory_source=c.choice(b, "memory_source", p, MemorySource.EFFECTIVE),
            max_inflight=c.integer(b, "max_inflight", p, 64, lo=1),
            kv_pool_bytes=c.integer(b, "kv_pool_bytes", p, 0, lo=1) if kv is not None else None,
            gpus=tuple(gpus),
            device_url=c.string(b, "device_url", p, "") or None,
            pool=c.string(b, "pool", p, "") or None,
        )
    return out


def _gpu_ref(g: Any) -> bool:
    return (isinstance(g, int) and not isinstance(g, bool) and g >= 0) or (
        isinstance(g, str) and g.startswith(("GPU-", "MIG-"))
    )


DEFAULT_KEYS = {"max_inflight", "memory_source", "kv_pool_bytes", "pool"}


def parse_discovery(c: Checker, raw: Any) -> Discovery:
    m = c.mapping(raw, "discovery", set(Discovery.__dataclass_fields__)) or {}
    d = Discovery()
    allow: list[str] = []
    for i, net in enumerate(c.string_list(m, "allow", "discovery", [])):
        try:
            allow.append(str(ipaddress.ip_network(net, strict=False)))
        except ValueError:
            c.err(f"discovery.allow[{i}]", f"must be an IP network or address, got {net!r}")
    out = Discovery(
        enabled=c.boolean(m, "enabled", "discovery", d.enabled),
        allow=tuple(allow),
        secret_file=c.string(m, "secret_file", "discovery", "") or None,
        forget_after_s=c.number(m, "forget_after_s", "discovery", d.forget_after_s, lo=1),
        max_nodes=c.integer(m, "max_nodes", "discovery", d.max_nodes, lo=1),
        defaults=_defaults(c, m.get("defaults")),
    )
    if out.enabled and not out.allow:
        c.err("discovery.allow", "must name the networks registered nodes may be in")
    if out.enabled and not out.secret_file:
        c.err("discovery.secret_file", "is required: registrations must carry its secret")
    return out


def _defaults(c: Checker, raw: Any) -> dict[str, dict[str, Any]]:
    """`discovery.defaults`: per model (or "*"), node keys checked as a listed node's are."""
    out: dict[str, dict[str, Any]] = {}
    if raw is None:
        return out
    m = c.mapping(raw, "discovery.defaults", None) or {}
    for model, body in m.items():
        p = f"discovery.defaults.{model}"
        b = c.mapping(body, p, DEFAULT_KEYS) or {}
        probe = Checker({})
        parse_nodes(probe, {"probe": {"url": "http://127.0.0.1", "models": ["m"], **b}})
        for problem in probe.problems:
            c.err(p, problem.replace("nodes.probe.", "").replace("nodes.probe", ""))
        out[str(model)] = dict(b)
    return out


def with_defaults(spec: Any, defaults: dict[str, dict[str, Any]]) -> Any:
    """A registration's spec with what it leaves out taken from `discovery.defaults`: its first
    model's entry, then "*"."""
    if not isinstance(spec, dict):
        return spec
    models = spec.get("models")
    first = models[0] if isinstance(models, list) and models else None
    return {**defaults.get("*", {}), **defaults.get(str(first), {}), **spec}


def allowed(url: str, allow: tuple[str, ...]) -> bool:
    """Whether `url`'s host is an address inside one of the `allow` networks (names are not
    resolved: a registration names its node by address)."""
    try:
        host = ipaddress.ip_address(urlsplit(url).hostname or "")
    except ValueError:
        return False
    return any(host in ipaddress.ip_network(net) for net in allow)


def registered_node(policy: Policy, nid: str, spec: Any) -> tuple[Node | None, str]:
    """The node a registration describes, or None and why it is refused: not a valid node
    entry, an id the policy lists already, a URL outside `discovery.allow`, a pool the policy
    does not have."""
    if nid in policy.nodes:
        return None, "the policy lists a node of that id"
    c = Checker({})
    nodes = parse_nodes(c, {nid: with_defaults(spec, policy.discovery.defaults)})
    if c.problems or nid not in nodes:
        return None, "; ".join(c.problems) or "not a node entry"
    node = nodes[nid]
    for url in (node.url, node.device_url):
        if url and not allowed(url, policy.discovery.allow):
            return None, f"{url} is outside discovery.allow"
    if node.pool is not None and node.pool not in policy.pools:
        return None, f"no pool {node.pool!r} in the policy"
    return node, ""
