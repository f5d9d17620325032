"""Where prompt heads went: this sidecar's prefix index, told to and heard from the others.

A lease taken with a prefix puts its blocks on the node (the engine computes them); the
sidecar learns that in its `PrefixIndex` (prefixes.py) and, when it is news, tells the other
sidecars through the prefix feed with its next refresh (one XADD each, one XRANGE for all), so
that every sidecar routes a prompt head to where any of them placed it, without a Redis call
on the admission path. It also keeps what each lease was booked as already cached, to compare
with what the engine reports at release (`admission_prefix_*_tokens_total`).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from admission.metrics import Metrics
from admission.nodes.feed import after
from admission.scheduling import leases
from admission.scheduling.ask import Ask
from admission.scheduling.prefixes import Prefix, PrefixIndex, pool_blocks
from admission.scheduling.views import NodeView
from admission.store import keys

PREDICTED_KEPT = 50_000  # tickets whose booked-as-cached tokens wait for their release here
FEED_BATCH = 4096  # placements a sidecar tells per refresh at most (more: not told)
FEED_LEN = 20_000  # placements the feed keeps (trimmed approximately): ~1 s at 20k admissions/s
FEED_READ = 20_000  # placements read per refresh at most


class Placements:
    def __init__(
        self,
        metrics: Metrics,
        clock: Callable[[], float],
        views: Callable[[], dict[str, NodeView]] = dict,
    ) -> None:
        self.metrics = metrics
        self.clock, self.views = clock, views
        self.index = PrefixIndex()
        # ticket → (tokens booked as cached, node, prompt head), until its release
        self._predicted: OrderedDict[str, tuple[int, str, Prefix]] = OrderedDict()
        # Placements told to the other sidecars with the next refresh, and the feed's last id
        # read ("0-0": a new sidecar first learns what the stream still holds).
        self._me = secrets.token_hex(4)
        self._outbox: list[tuple[str, Prefix]] = []
        self._feed_id: bytes | str = "0-0"

    def cached(self, prefix: Prefix) -> dict[str, int]:
        """Node → prompt tokens of `prefix` this sidecar expects its prefix cache to hold."""
        return (
            {n: prefix.tokens(b) for n, b in self.index.matches(prefix).items()} if prefix else {}
        )

    def booked(self, ticket: str, view: NodeView, ask: Ask, res: Any) -> None:
        """A lease with a prefix was taken on `view`: its blocks are there now (the engine
        computes them); remember what was booked as cached, to compare with the engine's count."""
        prefix = ask.prefix
        if not prefix:
            return
        hit = leases.hit_blocks(res)
        predicted = ask.hit_tokens if hit is None else prefix.tokens(hit)
        self._predicted[ticket] = (min(ask.prompt_tokens, predicted), view.node.id, prefix)
        if len(self._predicted) > PREDICTED_KEPT:  # released elsewhere, or lost: oldest out
            self._predicted.popitem(last=False)
        # Told to the other sidecars only when it is news here: a head already placed on this
        # node (the common case, once affinity holds) costs the feed nothing.
        news = self.index.learn(view.node.id, prefix, self.clock(), ask.pool_blocks)
        if news and len(self._outbox) < FEED_BATCH:
            self._outbox.append((view.node.id, prefix))

    def engine_cached(self, ticket: str, cached: int) -> bool:
        """The engine's `cached_tokens` for a released ticket (-1: not reported). True when it
        found none of a head this sidecar booked as held there (at least a block of it): the
        head's blocks are forgotten on that node here, and the caller lets them leave the
        node's resident set in the ledger, so the next copy books the prefill it will cost.
        Only none counts: the engine counts in its own tokens, the booking in the edge's
        estimate, so a partial difference says little; none says the engine keys it apart."""
        entry = self._predicted.pop(ticket, None)
        if cached < 0 or entry is None:
            return False
        predicted, node, prefix = entry
        self.metrics.prefix_predicted.inc(predicted)
        self.metrics.prefix_engine_cached.inc(cached)
        if cached > 0 or predicted < prefix.block_tokens:
            return False
        self.index.forget(node, prefix)
        return True

    def snapshot(self) -> dict[str, Any]:
        """Prompt tokens booked as already computed vs what the engines found cached, over the
        releases that reported it (None: none yet), and the engines' prompt tokens over the
        edge's estimate (the mean ratio; the ledger books in the estimate), for the status page."""
        get = self.metrics.registry.get_sample_value
        booked = get("admission_prefix_predicted_tokens_total") or 0.0
        found = get("admission_prefix_engine_cached_tokens_total") or 0.0
        reported = booked > 0 or found > 0
        n = get("admission_prompt_tokens_ratio_count") or 0.0
        ratio = (get("admission_prompt_tokens_ratio_sum") or 0.0) / n if n else None
        return {
            "booked_cached_tokens": int(booked) if reported else None,
            "engine_cached_tokens": int(found) if reported else None,
            "engine_prompt_ratio": None if ratio is None else round(ratio, 3),
        }

    def queue(self, pipe: Any) -> int:
        """A refresh rider (nodetable.Rider): queue what to tell (XADDs), then the read (XRANGE,
        last); return how many commands."""
        outbox, self._outbox = self._outbox, []
        feed = keys.prefix_feed()
        for node, prefix in outbox:
            fields = {"s": self._me, "n": node, "t": prefix.block_tokens}
            fields["b"] = " ".join(prefix.blocks)
            pipe.xadd(feed, fields, maxlen=FEED_LEN, approximate=True)
        pipe.xrange(feed, after(self._feed_id), "+", count=FEED_READ)
        return len(outbox) + 1

    def take(self, replies: list[Any]) -> None:
        """Take the other sidecars' placements from the prefix feed (the XRANGE, last). A failed
        call is counted, not told: a placement not told costs a cache hit, and a failed read
        is read again from the same entry at the next refresh."""
        if any(isinstance(r, Exception) for r in replies):
            self.metrics.redis_errors.labels("prefix_feed").inc()
        read = replies[-1] if replies else None
        if isinstance(read, Exception):
            return
        now, views = self.clock(), self.views()
        for entry_id, f in read or []:
            self._feed_id = entry_id
            if f.get(b"s", b"").decode() == self._me:
                continue
            node = f.get(b"n", b"").decode()
            v = views.get(node)
            try:
                prefix = Prefix(tuple(f.get(b"b", b"").decode().split()), int(f.get(b"t", 0)))
            except ValueError:
                continue
            if v is not None and prefix:
                self.index.learn(node, prefix, now, pool_blocks(v.pool_tokens, prefix))
