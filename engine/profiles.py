"""Hardware profiles for the emulator's step-time cost model.

A step is bound by the slower of memory and compute (roofline):
    memory  = (weights_bytes + Σ context_tokens × kv_bytes_per_token) / hbm_bytes_per_s
    compute = (prefill + decode tokens) × 2 × params / achievable FLOPs
Decode alone is memory-bound (weights read once per step); a step with a large prefill chunk is
compute-bound, so long prompts slow every running sequence's next token, as on a real GPU.
Public figures (see docs/benchmarks.md): A100-40GB HBM2 1.555 TB/s, 312 TFLOPS bf16;
H100-80GB SXM HBM3 3.35 TB/s, 989 TFLOPS bf16 (×2 with tensor parallel 2). Llama-3-8B: 8.0e9
params, 32 layers × 8 KV heads × 128 × 2 (K,V) × 2 B = 128 KiB KV per token; Llama-3-70B: 80
layers → 320 KiB per token (fp16).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

GiB = 1 << 30
FITTED = Path(__file__).with_name("fitted")  # profiles written by `loadtest.fit_engine`
FITTED_ENV = "ENGINE_FITTED_PROFILE"  # a fitted profile's file, in place of the shipped one


@dataclass(frozen=True)
class Profile:
    name: str
    model: str
    total_bytes: int  # GPU memory (summed over tensor-parallel GPUs)
    weights_bytes: int
    activation_bytes: int  # non-KV working memory vLLM reserves at start
    kv_bytes_per_token: int
    params: float
    hbm_bytes_per_s: float
    flops_per_s: float  # achievable (peak × MFU)
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    step_overhead_s: float = 0.002  # scheduler + sampling + launch per step
    context_bytes: int = 600 << 20  # CUDA context and allocator slack, outside vLLM's budget
    # A profile fitted to a measured engine (loadtest.fit_engine) replaces the roofline by the
    # fit: step = Σ coefficient × term, terms (1, prefill, prefill², decodes, context tokens,
    # requests waiting in the engine).
    fitted_step_s: tuple[float, ...] = ()
    request_overhead_s: float = 0.0  # HTTP, tokenizing, engine IPC before a request can start
    # The most requests waiting in the engine that the fit probed: the waiting term is not
    # extrapolated past it (0: no bound). A fit from 0/150/400 waiting put 0–6 µs on each,
    # which at 1,500 waiting made the emulated node 40 % slower than the real one.
    fitted_waiting_max: int = 0
    num_blocks_override: int = 0  # a KV pool set by block count (--num-gpu-blocks-override)
    max_model_len: int = 8192
    tokenizer: str = ""  # "tiny-llama": count and hash prompts with the real node's tokenizer
    device: bool = True  # False: a CPU engine, no device memory (memory source "kv")

    @property
    def kv_pool_bytes(self) -> int:
        return (
            int(self.total_bytes * self.gpu_memory_utilization)
            - self.weights_bytes
            - self.activation_bytes
        )

    @property
    def num_blocks(self) -> int:
        if self.num_blocks_override:
            return self.num_blocks_override
        return self.kv_pool_bytes // (self.kv_bytes_per_token * self.block_size)

    @property
    def compute_s_per_token(self) -> float:
        """Seconds of compute one prefilled or decoded token takes: 2 x params FLOPs."""
        return 2 * self.params / self.flops_per_s

    def step_s(
        self, prefill_tokens: int, context_tokens: int, decode_tokens: int = 0, waiting: int = 0
    ) -> float:
        """Seconds one engine step takes, roofline style: the step is bound by the slower of
        memory (weights read once + every running sequence's KV) and compute (2 × params
        FLOPs per prefilled or decoded token), plus a fixed per-step overhead. A fitted profile
        uses its measured model instead (`waiting`: requests queued in the engine, whose
        bookkeeping a CPU node pays for in every step)."""
        if self.fitted_step_s:
            if self.fitted_waiting_max:
                waiting = min(waiting, self.fitted_waiting_max)
            terms = (1.0, prefill_tokens, prefill_tokens**2, decode_tokens, context_tokens, waiting)
            return max(0.0, sum(c * t for c, t in zip(self.fitted_step_s, terms, strict=False)))
        memory = (
            self.weights_bytes + context_tokens * self.kv_bytes_per_token
        ) / self.hbm_bytes_per_s
        compute = (prefill_tokens + decode_tokens) * self.compute_s_per_token
        return self.step_overhead_s + max(memory, compute)


PROFILES = {
    "a100-40gb-llama3-8b": Profile(
        name="a100-40gb-llama3-8b",
        model="llama-3-8b",
        total_bytes=40 * GiB,
        weights_bytes=16 * GiB,
        activation_bytes=2 * GiB,
        kv_bytes_per_token=128 * 1024,
        params=8.0e9,
        hbm_bytes_per_s=1.555e12,
        flops_per_s=312e12 * 0.5,
    ),
    "h100-80gb-llama3-70b": Profile(
        name="h100-80gb-llama3-70b",
        model="llama-3-70b",
        total_bytes=2 * 80 * GiB,  # tensor parallel 2
        weights_bytes=70 * GiB,  # fp8 weights
        activation_bytes=4 * GiB,
        kv_bytes_per_token=320 * 1024,
        params=70e9,
        hbm_bytes_per_s=2 * 3.35e12,
        flops_per_s=2 * 989e12 * 0.4,
        max_num_seqs=512,
        max_num_batched_tokens=8192,
    ),
    # Small enough that a handful of requests move KV usage: for tests.
    "tiny": Profile(
        name="tiny",
        model="tiny",
        total_bytes=1 * GiB,
        weights_bytes=256 << 20,
        activation_bytes=64 << 20,
        kv_bytes_per_token=64 * 1024,
        params=1e8,
        hbm_bytes_per_s=1e11,
        flops_per_s=1e13,
        gpu_memory_utilization=0.5,  # 512 MiB - 320 MiB = 192 MiB pool = 3072 tokens = 192 blocks
        max_num_seqs=64,
        max_num_batched_tokens=512,
        step_overhead_s=0.005,
        context_bytes=16 << 20,
    ),
}


def load_fitted(path: Path) -> Profile:
    """A profile `loadtest.fit_engine` wrote (its `profile` object; the fit's evidence beside)."""
    doc = json.loads(path.read_text())["profile"]
    known = {f.name for f in fields(Profile)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(f"{path}: unknown profile fields {unknown}")
    if "fitted_step_s" in doc:
        doc["fitted_step_s"] = tuple(doc["fitted_step_s"])
    return Profile(**doc)


for _path in sorted(FITTED.glob("*.json")) if FITTED.is_dir() else ():
    _p = load_fitted(_path)
    PROFILES[_p.name] = _p
# A profile fitted elsewhere replaces the shipped one of its name, in this process and the
# emulated nodes it starts (loadtest.fidelity --refit-each: a fit made right before a mix).
if _extra := os.environ.get(FITTED_ENV):
    _p = load_fitted(Path(_extra))
    PROFILES[_p.name] = _p
