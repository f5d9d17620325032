"""GPU memory watermarks: the effective-memory formula and the node state machine. Pure.

vLLM pre-allocates its KV pool at start-up, so raw NVML "used" sits near
--gpu-memory-utilization whatever the load. The memory that moves with load is the KV cache in
use; everything else on the card (weights, activations, a leak, another process) is in NVML's
reading. Effective used memory counts the pre-allocated but *free* KV blocks as free:

    effective_used = nvml_used − kv_pool × (1 − kv_usage)
    fraction       = effective_used / nvml_total
"""

from __future__ import annotations

from dataclasses import dataclass

from admission.policy import Watermarks

OPEN, HOLD, DRAIN, DOWN, MAINTENANCE = "open", "hold", "drain", "down", "maintenance"
STATES = (OPEN, HOLD, DRAIN, DOWN, MAINTENANCE)


@dataclass(frozen=True)
class GpuMemory:
    """One reading of a GPU (or the sum over a tensor-parallel node's GPUs), in bytes."""

    used_bytes: int
    total_bytes: int


def effective_fraction(
    source: str,
    gpu: GpuMemory | None,
    kv_usage: float | None,
    kv_pool_bytes: int | None,
) -> float:
    """Memory fraction the watermarks compare against, for a node's `memory_source`.

    effective: NVML with free KV blocks counted as free (needs NVML, KV usage and pool size);
    kv: vLLM's KV usage alone (CPU vLLM, no NVML); nvml: raw NVML (no vLLM metrics).
    Raises ValueError when the source's inputs are missing: the agent reports the node down
    rather than guess.
    """
    if source == "kv":
        if kv_usage is None:
            raise ValueError("memory_source kv needs vllm:kv_cache_usage_perc")
        return _clamp(kv_usage)
    if gpu is None or gpu.total_bytes <= 0:
        raise ValueError(f"memory_source {source} needs an NVML reading")
    if source == "nvml":
        return _clamp(gpu.used_bytes / gpu.total_bytes)
    if kv_usage is None or kv_pool_bytes is None:
        raise ValueError("memory_source effective needs KV usage and the KV pool size")
    used = gpu.used_bytes - kv_pool_bytes * (1.0 - _clamp(kv_usage))
    return _clamp(used / gpu.total_bytes)


def next_state(current: str, fraction: float, wm: Watermarks) -> str:
    """Watermark transition with hysteresis (health and maintenance are decided elsewhere).

    open → hold at ≥ hold, → drain at ≥ drain; hold → drain at ≥ drain. Leaving needs the
    fraction to fall a band below the threshold (band = hold − reopen): drain → hold below
    drain − band, hold → open below reopen; so a node hovering at a threshold does not flap.
    """
    band = wm.hold - wm.reopen
    if fraction >= wm.drain:
        return DRAIN
    if current == DRAIN and fraction >= wm.drain - band:
        return DRAIN
    if current in (HOLD, DRAIN):
        return OPEN if fraction < wm.reopen else HOLD
    if fraction >= wm.hold:
        return HOLD
    return OPEN


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, float(x)))
