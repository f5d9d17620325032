"""What a policy change means, in plain words: `admission check --diff OLD NEW`. Pure.

An SRE reads this before shipping a change to a live cluster: limits raised or lowered (by how
much), tenants and classes added or removed, reweighting, watermarks and nodes.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from admission.policy.model import Policy


def _pct(old: float, new: float) -> str:
    if old == 0:
        return f"{old:g} → {new:g}"
    change = (new - old) / old * 100
    word = "raised" if new > old else "lowered"
    return f"{word} {abs(change):.0f}% ({old:g} → {new:g})"


def _fields(kind: str, old: Any, new: Any, skip: tuple[str, ...] = ()) -> list[str]:
    out = []
    for f in fields(old):
        if f.name in skip:
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a == b:
            continue
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            out.append(f"{kind} {f.name} {_pct(float(a), float(b))}")
        else:
            out.append(f"{kind} {f.name}: {a!r} → {b!r}")
    return out


def _discovery(old: Policy, new: Policy) -> list[str]:
    """`discovery:` in plain words: registration turned on or off, which networks may register."""
    a, b = old.discovery, new.discovery
    out = []
    if a.enabled != b.enabled:
        out.append(
            "discovery: nodes may now register themselves (admission agent --register)"
            if b.enabled
            else "discovery: off: registered nodes leave the views, listed ones stay"
        )
    for net in sorted(set(b.allow) - set(a.allow)):
        out.append(f"discovery: nodes in {net} may register")
    for net in sorted(set(a.allow) - set(b.allow)):
        out.append(f"discovery: nodes in {net} may no longer register (those registered leave)")
    if a.secret_file != b.secret_file:
        out.append("discovery: registrations are checked against another secret file")
    for model in sorted(set(a.defaults) | set(b.defaults)):
        was, now = a.defaults.get(model, {}), b.defaults.get(model, {})
        which = "every model" if model == "*" else f"model {model}"
        for key in sorted(set(was) | set(now)):
            if was.get(key) != now.get(key):
                out.append(
                    f"discovery: registered nodes of {which} that do not say their {key} take "
                    f"{now.get(key, 'the built-in default')} (was {was.get(key, 'the built-in default')})"
                )
    out += _fields("discovery", a, b, ("enabled", "allow", "secret_file", "defaults"))
    return out


def describe(old: Policy, new: Policy) -> list[str]:
    """One line per change; empty when the policies mean the same."""
    out: list[str] = []
    for tid in sorted(set(new.tenants) - set(old.tenants)):
        out.append(f"tenant {tid} added (weight {new.tenants[tid].weight:g})")
    for tid in sorted(set(old.tenants) - set(new.tenants)):
        out.append(f"tenant {tid} removed: its keys stop working")
    for tid in sorted(set(old.tenants) & set(new.tenants)):
        a, b = old.tenants[tid], new.tenants[tid]
        out += _fields(f"tenant {tid}: limit", a.limits, b.limits)
        if a.weight != b.weight:
            out.append(f"tenant {tid}: weight {_pct(a.weight, b.weight)}")
        if set(a.key_digests) != set(b.key_digests):
            added, gone = (
                len(set(b.key_digests) - set(a.key_digests)),
                len(set(a.key_digests) - set(b.key_digests)),
            )
            out.append(f"tenant {tid}: {added} key(s) added, {gone} revoked")
        if a.classes != b.classes:
            out.append(f"tenant {tid}: classes {list(a.classes)} → {list(b.classes)}")
        if a.shadow != b.shadow:
            out.append(
                f"tenant {tid}: limits {'shadowed (not enforced)' if b.shadow else 'enforced'}"
            )
    out += _cache_groups(old, new)
    for name in sorted(set(new.classes) - set(old.classes)):
        out.append(f"class {name} added")
    for name in sorted(set(old.classes) - set(new.classes)):
        out.append(f"class {name} removed: its queued requests move to the lowest class")
    for name in sorted(set(old.classes) & set(new.classes)):
        out += _fields(f"class {name}:", old.classes[name], new.classes[name], ("name",))
    out += _fields("watermarks", old.watermarks, new.watermarks)
    out += _fields("queue", old.queue, new.queue)
    out += _fields("edge", old.edge, new.edge)
    out += _discovery(old, new)
    for nid in sorted(set(new.nodes) - set(old.nodes)):
        out.append(f"node {nid} added ({new.nodes[nid].url})")
    for nid in sorted(set(old.nodes) - set(new.nodes)):
        out.append(f"node {nid} removed: it gets no new requests")
    for nid in sorted(set(old.nodes) & set(new.nodes)):
        out += _fields(f"node {nid}:", old.nodes[nid], new.nodes[nid], ("id",))
    for name in sorted(set(new.pools) - set(old.pools)):
        pool = new.pools[name]
        out.append(
            f"pool {name} added: owned by {', '.join(pool.tenants)}"
            f"{', lends idle capacity' if pool.lend else ', never lent'}"
        )
    for name in sorted(set(old.pools) - set(new.pools)):
        out.append(f"pool {name} removed: its nodes are shared by every tenant")
    for name in sorted(set(old.pools) & set(new.pools)):
        out += _fields(f"pool {name}:", old.pools[name], new.pools[name], ("name",))
    return out


def _cache_groups(old: Policy, new: Policy) -> list[str]:
    """What a change shares: a tenant joining or leaving a cache group, with whom it now shares
    the engine's prefix cache (each of them can tell whether the others sent a prompt)."""
    out = []
    for tid in sorted(set(old.tenants) & set(new.tenants)):
        a, b = old.tenants[tid].cache_group, new.tenants[tid].cache_group
        if a == b:
            continue
        if b is None:
            out.append(f"tenant {tid}: prefix cache its own again (left cache group {a})")
            continue
        others = sorted(t.id for t in new.tenants.values() if t.cache_group == b and t.id != tid)
        with_whom = ", ".join(others) if others else "no other tenant yet"
        out.append(f"tenant {tid}: shares its prefix cache in group {b} with {with_whom}")
    for tid in sorted(set(new.tenants) - set(old.tenants)):
        if (g := new.tenants[tid].cache_group) is not None:
            out.append(f"tenant {tid}: shares its prefix cache in group {g}")
    return out
