"""Validation helpers for the policy loader: typed reads that record problems instead of raising.

Every read takes the mapping, the key and the dotted path of the mapping, and returns a usable
default when the value is wrong, so that one pass reports every problem in the file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import StrEnum
from typing import Any, TypeVar

import yaml

E = TypeVar("E", bound=StrEnum)


def line_map(
    node: yaml.Node | None, path: str = "", out: dict[str, int] | None = None
) -> dict[str, int]:
    """Dotted path → 1-based YAML line, from a composed node tree."""
    out = {} if out is None else out
    if node is None:
        return out
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            sub = f"{path}.{k.value}" if path else str(k.value)
            out[sub] = k.start_mark.line + 1
            line_map(v, sub, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            line_map(v, f"{path}[{i}]", out)
    return out


def duplicate_keys(node: yaml.Node | None, path: str = "") -> list[tuple[str, int]]:
    """(dotted path, line) of every key that appears twice in one mapping.

    PyYAML silently keeps the last duplicate; for tenants or nodes that would drop one without
    a word, so the loader reports them instead.
    """
    out: list[tuple[str, int]] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for k, v in node.value:
            sub = f"{path}.{k.value}" if path else str(k.value)
            if k.value in seen:
                out.append((sub, k.start_mark.line + 1))
            seen.add(k.value)
            out.extend(duplicate_keys(v, sub))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out.extend(duplicate_keys(v, f"{path}[{i}]"))
    return out


def redact(url: str) -> str:
    """A URL with any password replaced: `redis://:secret@host` → `redis://:***@host`."""
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", url)


# What may be an API key pasted in the wrong place: an OpenAI-style `sk-…`, or one unbroken
# token of 16+ letters, digits, `-` and `_` (random keys look like that; names rarely do).
_KEYLIKE = re.compile(r"sk-|^[A-Za-z0-9_-]{16,}$")


def shown(v: Any) -> str:
    """A value for an error message, never a secret: containers and strings that may hold a
    key (`plain:`, a bare key typed where a value was due) or a URL password are named, not
    printed."""
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, str):
        secret = "plain:" in v or "@" in v or len(v) > 40 or _KEYLIKE.search(v)
        return "a string" if secret else repr(v)
    return f"{type(v).__name__} {v!r}"


_PLAIN = re.compile(r"(plain:|\bsk-)[^\s'\",\]}]*")


class Checker:
    def __init__(self, lines: dict[str, int]) -> None:
        self.lines = lines
        self.problems: list[str] = []

    def err(self, path: str, message: str) -> None:
        line = self.lines.get(path)
        where = f" (line {line})" if line else ""
        # The last guard: whatever a message quotes (a key name included), no demo key leaves.
        text = f"{path or '<root>'}{where}: {message}"
        self.problems.append(_PLAIN.sub(lambda m: m.group(1) + "***", text))

    def mapping(
        self, value: Any, path: str, allowed: set[str] | None, required: Iterable[str] = ()
    ) -> dict[Any, Any] | None:
        if value is None and not path:
            self.err(path, "file is empty")
            return None
        if not isinstance(value, dict):
            self.err(path, f"must be a mapping, got {type(value).__name__}")
            return None
        for key in value:
            if allowed is not None and key not in allowed:
                self.err(_join(path, key), f"unknown key (allowed: {', '.join(sorted(allowed))})")
        for key in required:
            if key not in value:
                self.err(_join(path, key), "is required")
        return value

    def number(
        self,
        m: dict[Any, Any],
        key: str,
        path: str,
        default: float | None,
        *,
        lo: float | None = None,
        hi: float | None = None,
        lo_open: bool = False,
    ) -> float:
        fallback = float(default) if default is not None else 1.0
        if key not in m:
            return fallback
        v = m[key]
        p = _join(path, key)
        if isinstance(v, bool) or not isinstance(v, int | float):
            self.err(p, f"must be a number, got {shown(v)}")
            return fallback
        if lo is not None and (v <= lo if lo_open else v < lo):
            self.err(p, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
            return fallback
        if hi is not None and v > hi:
            self.err(p, f"must be <= {hi}, got {v}")
            return fallback
        return float(v)

    def optional_number(
        self, m: dict[Any, Any], key: str, path: str, *, lo: float, lo_open: bool = False
    ) -> float | None:
        if m.get(key) is None:
            return None
        return self.number(m, key, path, None, lo=lo, lo_open=lo_open)

    def integer(
        self,
        m: dict[Any, Any],
        key: str,
        path: str,
        default: int,
        *,
        lo: int | None = None,
        hi: int | None = None,
    ) -> int:
        if key not in m:
            return default
        v = m[key]
        p = _join(path, key)
        if isinstance(v, bool) or not isinstance(v, int):
            self.err(p, f"must be an integer, got {shown(v)}")
            return default
        if lo is not None and v < lo:
            self.err(p, f"must be >= {lo}, got {v}")
            return default
        if hi is not None and v > hi:
            self.err(p, f"must be <= {hi}, got {v}")
            return default
        return v

    def string(
        self, m: dict[Any, Any], key: str, path: str, default: str, prefixes: tuple[str, ...] = ()
    ) -> str:
        if key not in m:
            return default
        v = m[key]
        p = _join(path, key)
        if not isinstance(v, str) or not v:
            self.err(p, f"must be a non-empty string, got {shown(v)}")
            return default
        if prefixes and not v.startswith(prefixes):
            self.err(p, f"must start with one of {', '.join(prefixes)}, got {redact(v)!r}")
            return default
        return v

    def choice(self, m: dict[Any, Any], key: str, path: str, default: E) -> E:
        """A member of `default`'s enum, written as its value."""
        kind = type(default)
        v = self.string(m, key, path, default.value)
        try:
            return kind(v)
        except ValueError:
            options = ", ".join(e.value for e in kind)
            self.err(_join(path, key), f"must be one of {options}, got {shown(v)}")
            return default

    def boolean(self, m: dict[Any, Any], key: str, path: str, default: bool) -> bool:
        v = m.get(key, default)
        if not isinstance(v, bool):
            self.err(_join(path, key), f"must be true or false, got {shown(v)}")
            return default
        return v

    def string_list(self, m: dict[Any, Any], key: str, path: str, default: list[str]) -> list[str]:
        if key not in m:
            return default
        v = m[key]
        p = _join(path, key)
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            self.err(p, "must be a list of non-empty strings")
            return default
        for i, x in enumerate(v):
            if x in v[:i]:
                self.err(f"{p}[{i}]", f"duplicate {x!r}")
        return list(v)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def is_id(v: Any) -> bool:
    """A tenant's or node's id: letters, digits, '-', '_' or '.' (it is part of Redis keys)."""
    return isinstance(v, str) and bool(v) and all(ch.isalnum() or ch in "-_." for ch in v)
