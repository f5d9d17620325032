"""Memory sources: how a node's memory fraction is read, one registered reader per source.

vLLM pre-allocates its KV pool at start-up, so raw NVML "used" sits near
--gpu-memory-utilization whatever the load. The memory that moves with load is the KV cache in
use; everything else on the card (weights, activations, a leak, another process) is in NVML's
reading. Effective used memory counts the pre-allocated but *free* KV blocks as free:

    effective_used = nvml_used − kv_pool × (1 − kv_usage)
    fraction       = effective_used / nvml_total

A new source is one function registered here (`@source(MemorySource.X)`) and one enum value in
the policy; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from admission.nodes.gpu import GpuMemory
from admission.policy import MemorySource


@dataclass(frozen=True)
class Inputs:
    """What the agent read from a node in one sample (None: not available)."""

    gpu: GpuMemory | None
    kv_usage: float | None
    kv_pool_bytes: int | None
    kv_tokens: int | None = None  # KV pool capacity in tokens (blocks × block size)


@dataclass(frozen=True)
class Reader:
    fraction: Callable[[Inputs], float]  # raises ValueError when its inputs are missing
    per_token: Callable[[Inputs], float]  # memory fraction one token of KV takes (0: unknown)
    ready: Callable[[Inputs], bool]  # has what `fraction` needs


SOURCES: dict[MemorySource, Reader] = {}


def source(
    name: MemorySource, ready: Callable[[Inputs], bool], per_token: Callable[[Inputs], float]
) -> Callable[[Callable[[Inputs], float]], Callable[[Inputs], float]]:
    def register(fn: Callable[[Inputs], float]) -> Callable[[Inputs], float]:
        SOURCES[name] = Reader(fn, per_token, ready)
        return fn

    return register


def _gpu_per_token(i: Inputs) -> float:
    if not i.kv_tokens or not i.kv_pool_bytes or i.gpu is None or i.gpu.total_bytes <= 0:
        return 0.0
    return i.kv_pool_bytes / i.kv_tokens / i.gpu.total_bytes


def _has_gpu(i: Inputs) -> bool:
    return i.gpu is not None and i.gpu.total_bytes > 0


@source(
    MemorySource.KV,
    ready=lambda i: i.kv_usage is not None,
    per_token=lambda i: 1.0 / i.kv_tokens if i.kv_tokens else 0.0,
)
def kv(i: Inputs) -> float:
    """vLLM's KV usage alone: CPU vLLM, where there is no NVML."""
    if i.kv_usage is None:
        raise ValueError("memory_source kv needs vllm:kv_cache_usage_perc")
    return clamp(i.kv_usage)


@source(MemorySource.NVML, ready=_has_gpu, per_token=_gpu_per_token)
def nvml(i: Inputs) -> float:
    """Raw NVML: nodes without a vLLM metrics endpoint."""
    if i.gpu is None or i.gpu.total_bytes <= 0:
        raise ValueError("memory_source nvml needs an NVML reading")
    return clamp(i.gpu.used_bytes / i.gpu.total_bytes)


@source(
    MemorySource.EFFECTIVE,
    per_token=_gpu_per_token,
    ready=lambda i: _has_gpu(i) and i.kv_pool_bytes is not None,
)
def effective(i: Inputs) -> float:
    """NVML with the free KV blocks counted as free (needs NVML, KV usage and pool size)."""
    if i.gpu is None or i.gpu.total_bytes <= 0:
        raise ValueError("memory_source effective needs an NVML reading")
    if i.kv_usage is None or i.kv_pool_bytes is None:
        raise ValueError("memory_source effective needs KV usage and the KV pool size")
    used = i.gpu.used_bytes - i.kv_pool_bytes * (1.0 - clamp(i.kv_usage))
    return clamp(used / i.gpu.total_bytes)


def fallback(wanted: MemorySource, i: Inputs) -> MemorySource:
    """The source to use this sample: `wanted` if it has its inputs; effective without its
    inputs falls back to nvml (no KV pool size) or kv (no NVML)."""
    if SOURCES[wanted].ready(i) or wanted != MemorySource.EFFECTIVE:
        return wanted
    for alt in (MemorySource.NVML, MemorySource.KV):
        if SOURCES[alt].ready(i):
            return alt
    return wanted


def effective_fraction(
    src: MemorySource | str,
    gpu: GpuMemory | None,
    kv_usage: float | None,
    kv_pool_bytes: int | None,
) -> float:
    """The fraction the watermarks compare, for one source; ValueError when inputs are missing
    (the agent reports the node down rather than guess)."""
    return SOURCES[MemorySource(src)].fraction(Inputs(gpu, kv_usage, kv_pool_bytes))


def clamp(x: float) -> float:
    return min(1.0, max(0.0, float(x)))
