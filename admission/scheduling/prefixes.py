"""Prompt prefixes: what the edge says a prompt starts with, and where this sidecar saw it go.

The edge fingerprints the head of what the engine will see (messages with their roles, tools)
as chained hashes of fixed-size character blocks (`admission/edge/request.lua`): block i's hash
covers the whole text up to its end, so two prompts share block i exactly when they share
everything before it. No tokenizer runs at the edge; a block is `chars / chars_per_token`
tokens, as the edge's prompt estimate counts them.

Two indexes use it:
- the node ledger in Redis (lease.lua) is the authority: which blocks are resident on a node,
  and how many live leases hold each, shared by every sidecar. A request books KV and pending
  prefill only for what its node does not already hold;
- `PrefixIndex` here is this sidecar's guess of the same, for routing: learned from the leases
  it took and those the other sidecars told through the prefix feed (nodetable.py), bounded
  per node by the engine's KV pool (least recently used out first, as vLLM evicts). It only
  routes: a wrong guess costs a worse choice, never a wrong booking. Lookups cost what the request's blocks and the nodes holding them cost, not
  the size of the cluster: an inverted index block → nodes. Pure: no I/O, time injected.
"""

from __future__ import annotations

import re
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_BLOCKS = 64  # blocks the edge sends at most (64 × 512 characters ≈ 8k tokens of head)
UNKNOWN_POOL_BLOCKS = 16_384  # a node's pool when its engine does not say (2M tokens at 128)
BLOCK_HASH = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class Prefix:
    """A prompt's head as the edge fingerprinted it: chained block hashes, in order."""

    blocks: tuple[str, ...] = ()
    block_tokens: int = 0  # tokens one block stands for (its characters ÷ chars_per_token)

    def __bool__(self) -> bool:
        return bool(self.blocks) and self.block_tokens > 0

    def tokens(self, n_blocks: int) -> int:
        return n_blocks * self.block_tokens


NO_PREFIX = Prefix()


def parse(raw: Any, block_chars: Any, chars_per_token: float) -> Prefix:
    """The `prefix` / `prefix_chars` fields of an admission ask; ValueError if malformed."""
    if raw is None:
        return NO_PREFIX
    if not isinstance(raw, list) or len(raw) > MAX_BLOCKS:
        raise ValueError(f"prefix must be a list of at most {MAX_BLOCKS} block hashes")
    if not all(isinstance(b, str) and BLOCK_HASH.fullmatch(b) for b in raw):
        raise ValueError("prefix blocks must be 16 lowercase hex digits each")
    if not isinstance(block_chars, int) or isinstance(block_chars, bool) or block_chars < 1:
        raise ValueError("prefix_chars must be a positive integer")
    if not raw:
        return NO_PREFIX
    return Prefix(tuple(raw), max(1, int(block_chars / chars_per_token)))


def home_rank(prefix: Prefix, node: str) -> int:
    """Rendezvous hash of the prefix's first block and a node: among nodes equal by load and by
    what this sidecar knows they hold, every sidecar picks the same one for a prompt head it has
    not seen yet, so that sidecars of one cluster build one copy of it rather than one each
    (0 for every node without a prefix: no preference)."""
    if not prefix:
        return 0
    return zlib.crc32(f"{prefix.blocks[0]}/{node}".encode())


def pool_blocks(pool_tokens: int, prefix: Prefix) -> int:
    """Prefix blocks a KV pool of `pool_tokens` keeps computed; an unknown pool (no engine
    metrics) is taken as `UNKNOWN_POOL_BLOCKS`, so that neither index grows without bound."""
    if not prefix:
        return 0
    return pool_tokens // prefix.block_tokens if pool_tokens > 0 else UNKNOWN_POOL_BLOCKS


class PrefixIndex:
    """Which nodes this sidecar believes hold which prefix blocks (block → node → last used)."""

    def __init__(self) -> None:
        self._where: dict[str, dict[str, float]] = {}
        self._lru: dict[str, OrderedDict[str, None]] = {}  # node → its blocks, oldest first

    def matches(self, prefix: Prefix) -> dict[str, int]:
        """Node → how many of the prefix's leading blocks it holds (nodes holding none absent)."""
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for i, b in enumerate(prefix.blocks):
            holders = self._where.get(b)
            if not holders:
                break
            alive = set(holders) if alive is None else alive.intersection(holders)
            if not alive:
                break
            for n in alive:
                out[n] = i + 1
        return out

    def learn(self, node: str, prefix: Prefix, now: float, cap_blocks: int = 0) -> int:
        """`node` holds the prefix's blocks now (a lease was taken there); how many of them this
        index did not know there. `cap_blocks`: what its KV pool keeps (0: unbounded); past it
        the least recently used blocks are forgotten."""
        lru = self._lru.setdefault(node, OrderedDict())
        new = 0
        for b in prefix.blocks:
            new += b not in lru
            self._where.setdefault(b, {})[node] = now
            lru[b] = None
            lru.move_to_end(b)
        while cap_blocks > 0 and len(lru) > cap_blocks:
            self._drop(node, lru.popitem(last=False)[0])
        return new

    def forget(self, node: str, prefix: Prefix) -> None:
        """`node` does not hold these blocks after all (the engine found none of them)."""
        lru = self._lru.get(node)
        for b in prefix.blocks:
            if lru is not None:
                lru.pop(b, None)
            self._drop(node, b)

    def drop_node(self, node: str) -> None:
        """Forget everything on a node (it restarted, went down, or left the policy)."""
        for b in self._lru.pop(node, OrderedDict()):
            self._drop(node, b)

    def blocks(self, node: str) -> int:
        return len(self._lru.get(node, ()))

    def _drop(self, node: str, b: str) -> None:
        holders = self._where.get(b)
        if holders is not None:
            holders.pop(node, None)
            if not holders:
                del self._where[b]
