"""Effective memory and the node state machine, on hand-computed cases; the NVML reader."""

from __future__ import annotations

import pytest

from admission.nodes.agent import parse_vllm_metrics
from admission.nodes.gpu import GpuMemory, NvmlReader
from admission.nodes.memory import effective_fraction
from admission.nodes.watermarks import DOWN, DRAIN, HOLD, OPEN, next_state
from admission.policy import Watermarks

GiB = 1 << 30
WM = Watermarks(hold=0.80, drain=0.85, reopen=0.75, stale_after_s=3)


def test_effective_memory_counts_free_kv_blocks_as_free() -> None:
    # 80 GiB card, vLLM took 72 GiB (0.9) of which 40 GiB is KV pool.
    gpu = GpuMemory(used_bytes=72 * GiB, total_bytes=80 * GiB)
    assert effective_fraction("effective", gpu, 0.0, 40 * GiB) == pytest.approx(32 / 80)
    assert effective_fraction("effective", gpu, 0.5, 40 * GiB) == pytest.approx(52 / 80)
    assert effective_fraction("effective", gpu, 1.0, 40 * GiB) == pytest.approx(72 / 80)
    # Raw NVML would sit at 0.9 (drained) from the first second: the trap DESIGN.md describes.
    assert effective_fraction("nvml", gpu, 0.0, None) == pytest.approx(0.9)
    # A leak of 8 GiB elsewhere on the card shows up in effective memory; KV usage alone misses it.
    leak = GpuMemory(used_bytes=80 * GiB, total_bytes=80 * GiB)
    assert effective_fraction("effective", leak, 0.0, 40 * GiB) == pytest.approx(40 / 80)
    assert effective_fraction("kv", None, 0.3, None) == pytest.approx(0.3)


def test_missing_inputs_are_errors_not_guesses() -> None:
    with pytest.raises(ValueError):
        effective_fraction("effective", None, 0.5, GiB)
    with pytest.raises(ValueError):
        effective_fraction("effective", GpuMemory(1, 2), None, GiB)
    with pytest.raises(ValueError):
        effective_fraction("kv", None, None, None)


@pytest.mark.parametrize(
    ("state", "fraction", "expected"),
    [
        (OPEN, 0.79, OPEN),
        (OPEN, 0.80, HOLD),
        (OPEN, 0.85, DRAIN),
        (HOLD, 0.78, HOLD),  # hysteresis: not below reopen yet
        (HOLD, 0.7499, OPEN),
        (HOLD, 0.86, DRAIN),
        (DRAIN, 0.84, DRAIN),  # between hold and drain: stays drained
        (DRAIN, 0.79, HOLD),
        (DRAIN, 0.74, OPEN),
        (DOWN, 0.50, OPEN),
        (DOWN, 0.82, HOLD),
    ],
)
def test_state_machine(state: str, fraction: float, expected: str) -> None:
    assert next_state(state, fraction, WM) == expected


def test_no_flapping_around_hold() -> None:
    state = OPEN
    seen = []
    for f in [0.79, 0.80, 0.79, 0.80, 0.79, 0.76, 0.74, 0.76]:
        state = next_state(state, f, WM)
        seen.append(state)
    assert seen == [OPEN, HOLD, HOLD, HOLD, HOLD, HOLD, OPEN, OPEN]


VLLM_METRICS = """
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 7.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 4000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 3000.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="1000",kv_cache_memory_bytes="2097152000"} 1.0
"""


def test_parse_vllm_metrics() -> None:
    s = parse_vllm_metrics(VLLM_METRICS)
    assert (s.kv_usage, s.running, s.waiting, s.preemptions) == (0.25, 3, 2, 7.0)
    assert s.kv_tokens == 16_000 and s.kv_pool_bytes == 2_097_152_000
    assert (s.prefix_queries, s.prefix_hits) == (4000.0, 3000.0)


def test_prefix_hit_ratio_is_recent_hits_over_queries() -> None:
    from admission.nodes.rates import PrefixHits

    h = PrefixHits()
    assert h.update(None, None) is None  # an engine that does not report it
    assert h.update(1000.0, 0.0) is None  # one sample: no interval yet
    assert h.update(2000.0, 750.0) == pytest.approx(0.75)  # 750 of 1,000 looked up were cached
    assert h.update(2000.0, 750.0) == pytest.approx(0.75)  # nothing looked up: unchanged
    assert h.update(3000.0, 750.0) == pytest.approx(0.8 * 0.75)  # none cached since: smoothed


def test_nvml_reader_against_pynvml() -> None:
    """On a host without a GPU the reader says so; with one, it returns real totals."""
    reader = NvmlReader()
    try:
        if not reader.available:
            assert reader.read_sync((0,)) is None and reader.device_count() == 0
        else:
            mem = reader.read_sync((0,))
            assert mem is not None and 0 < mem.used_bytes <= mem.total_bytes
    finally:
        reader.close()


def _completions(prompt: float, rate: float, seconds: float, gap_s: float = 0.0):
    """(time, counter) samples every 0.2 s of a node clearing `rate` tokens/s that counts each
    prompt when its prefill completes, whole — as vLLM does — with `gap_s` idle between them."""
    t, done, nxt = 0.0, 0.0, prompt / rate
    while t < seconds:
        t = round(t + 0.2, 6)
        while nxt <= t:
            done, nxt = done + prompt, nxt + prompt / rate + gap_s
        yield t, done


@pytest.mark.parametrize("prompt", [50, 300, 2_000, 7_000])
def test_prefill_rate_is_the_node_speed_whatever_the_prompt_length(prompt: int) -> None:
    """A 7,000-token prompt counted whole at its end put 35,000 tokens/s into one 0.2 s sample
    of a node that clears 9,000 (the peak of such samples drained the ledger 2-4× too fast on
    long-prompt mixes); spans between completions read the speed itself."""
    from admission.nodes.rates import PrefillRate

    r = PrefillRate()
    seen = [r.update(t, c) for t, c in _completions(prompt, 9_000.0, 20.0)]
    spans = seen[int(4.0 / 0.2) :]  # read from spans within a few seconds of work
    assert max(spans) <= 9_000.0 * 1.001  # never above the node's speed
    assert seen[-1] == pytest.approx(9_000.0, rel=0.05)


def test_prefill_rate_keeps_its_decaying_peak_while_idle() -> None:
    from admission.nodes.rates import PrefillRate

    r = PrefillRate()
    assert r.update(0.0, 0.0) == 0.0  # unknown until spans between completions were seen
    for t, c in _completions(1_000, 10_000.0, 10.0):
        peak = r.update(t, c)
    assert peak == pytest.approx(10_000.0, rel=0.1)  # low by the sampling's slack at most
    assert r.update(10.2, c) == pytest.approx(peak * PrefillRate.DECAY)  # idle: keeps the peak
    peak *= PrefillRate.DECAY
    assert r.update(10.25, c + 9e6) == pytest.approx(peak)  # too short a sample: ignored
    # Sparse work (1 s idle after each prompt) reads lower, never higher: the peak stays.
    for t, d in _completions(7_000, 10_000.0, 10.0, gap_s=1.0):
        assert r.update(10.4 + t, c + d) <= peak
    assert r.update(21.0, 0.0) <= peak  # a restarted engine's counter: no bogus span
    assert r.update(21.4, 5_000.0) <= peak  # nor right after it


def test_prefill_rate_from_spans_reads_what_the_node_was_given_and_replaces_samples() -> None:
    """Before any span a single sample's figure stands; the first span replaces it. Given
    1,500 tokens/s, a node reads 1,500 in its spans whatever its speed: below saturation the
    spans say how busy a node was (PrefillSpeed says how fast it is)."""
    from admission.nodes.rates import PrefillRate

    r = PrefillRate()
    r.update(0.0, 0.0)
    assert r.update(0.2, 7_000.0) == pytest.approx(35_000.0)  # no span yet: the sample
    t, c = 0.2, 7_000.0
    for _ in range(12):  # 300 tokens every 0.2 s
        t, c = round(t + 0.2, 6), c + 300.0
        got = r.update(t, c)
    assert got == pytest.approx(1_500.0, rel=0.1)  # the first span replaced the 35,000


def test_prefill_rate_of_a_node_seen_idle_is_never_above_its_speed_from_its_first_prompt() -> None:
    """Seen idle before its first 7,000-token prompt, a node that clears 9,000 tokens/s reads
    its rate from the idle sample on: low by the sampling's slack, never high (the single
    sample read 35,000, kept until the first span ~3 s later)."""
    from admission.nodes.rates import PrefillRate

    r = PrefillRate()
    assert r.update(0.0, 0.0, busy=False) == 0.0
    t, done, nxt = 0.0, 0.0, 0.05 + 7_000 / 9_000.0  # the first prompt arrives at 0.05 s
    seen = []
    while t < 6.0:
        t = round(t + 0.2, 6)
        while nxt <= t:
            done, nxt = done + 7_000, nxt + 7_000 / 9_000.0
        seen.append(r.update(t, done, busy=True))
    first = next(x for x in seen if x > 0)
    assert 0.7 * 9_000 <= first <= 9_000.0  # 7,000 over the 1.0 s since the idle sample
    assert max(seen) <= 9_000.0 * 1.001
    assert seen[-1] == pytest.approx(9_000.0, rel=0.05)
    assert r.update(t + 0.2, done, busy=False) <= 9_000.0  # idle again: nothing new read
    r2 = PrefillRate()
    r2.update(0.0, 50_000.0, busy=True)  # an agent started on a busy node: no idle sample
    assert r2.update(0.2, 57_000.0, busy=True) == pytest.approx(35_000.0)  # the sample stands
    assert r2.update(0.4, 0.0, busy=False) == pytest.approx(35_000.0)  # engine restarted, idle
    assert r2.update(1.4, 2_000.0, busy=True) == pytest.approx(2_000.0)  # the span replaces it


def test_prefill_speed_is_tokens_over_time_in_prefill_of_finished_requests() -> None:
    """A lone 100-token prefill in 20 ms reads 5,000 tokens/s at any load; the sums decay so
    that a node that got slower is followed; a restarted engine starts over; no histograms
    (an older engine), no figure."""
    from admission.nodes.rates import PrefillSpeed

    p = PrefillSpeed()
    assert p.update(0.0, 0.0, 0.0) == 0.0
    assert p.update(1.0, 100.0, 0.02) == 0.0  # under MIN_S of evidence: no figure yet
    assert p.update(2.0, 300.0, 0.06) == pytest.approx(5_000.0)
    for i in range(3, 60):  # slower since: 100 tokens in 50 ms per second
        got = p.update(float(i), 300.0 + 100 * (i - 2), 0.06 + 0.05 * (i - 2))
    assert got == pytest.approx(2_000.0, rel=0.05)
    assert p.update(61.0, 10.0, 0.001) == pytest.approx(got)  # restarted: the last figure
    assert p.update(62.0, None, None) == pytest.approx(got)


def test_decode_time_is_what_requests_see_over_steps_of_unequal_length() -> None:
    """A prefill-heavy node: ten running requests, steps of 15 ms (decode only) and one of
    220 ms every 0.6 s (a 2,048-token chunk). Sampled every 0.2 s the requests see 0.6 s / 27
    steps ≈ 22 ms a token (`decode_s`); `tpot_s`, the last sample's figure, reads ~200 ms
    after each long step."""
    from admission.nodes.rates import Tpot

    t, gen, now = Tpot(), 0.0, 0.0
    t.update(now, gen, 10)
    spikes = []
    for i in range(60):
        now = round(now + 0.2, 6)
        steps = 1 if i % 3 == 0 else 13  # the chunk step; then decode steps
        gen += 10 * steps
        spikes.append(t.update(now, gen, 10))
    assert t.decode_s == pytest.approx(0.6 / 27, rel=0.1)
    assert max(spikes[-6:]) > 4 * t.decode_s  # what the lower classes' guard sees


def test_decode_time_weighs_the_last_seconds_and_starts_over_when_idle() -> None:
    from admission.nodes.rates import Tpot

    d = Tpot()
    d.update(0.0, None, 3)
    assert d.decode_s == 0.0  # no counter: unknown
    d.update(0.0, 0.0, 10)
    d.update(1.0, 200.0, 10)
    assert d.decode_s == pytest.approx(0.05)  # 10 running, 200 tokens/s: 50 ms
    half = 0.5 ** (1 / Tpot.HALF_S)
    d.update(2.0, 300.0, 10)  # slower since: 100 ms, weighed in
    got = d.decode_s
    assert got == pytest.approx((10 * half + 10) / (200 * half + 100))
    d.update(2.05, 400.0, 10)  # too short a sample: ignored
    assert d.decode_s == got
    d.update(2.2, 300.0, 0)
    assert d.decode_s == 0.0  # idle: nothing running sees anything
    d.update(2.4, 310.0, 10)  # busy again: from this spell only
    d.update(2.6, 330.0, 10)
    assert d.decode_s == pytest.approx(0.1)


def test_tpot_is_running_over_output_rate() -> None:
    from admission.nodes.rates import Tpot

    t = Tpot()
    t.update(0.0, 0.0, 10)
    assert t.update(1.0, 200.0, 10) == pytest.approx(0.05)  # 10 running, 200 tokens/s: 50 ms
    assert t.update(2.0, 300.0, 10) == pytest.approx(0.5 * 0.1 + 0.5 * 0.05)  # slower, smoothed
    assert Tpot().update(0.0, None, 3) == 0.0
