"""GPU check (needs a real NVIDIA GPU): the NVML reader and the watermarks on a real card.

    .venv/bin/python scripts/gpu_check.py [--device 0] [--hold 0.80] [--drain 0.85]

Reads the card through admission.gpu.NvmlReader (pynvml), then allocates memory with torch in
steps until NVML "used" crosses the drain watermark, printing at each step the reading, the
fraction (memory_source nvml) and the state the watermark state machine gives; then frees it
and shows the node reopen below the reopen level. Exits non-zero if a transition is missing.
Also reads the card by its UUID (how a policy names a MIG instance) and checks it is the same.
No torch? `pip install torch` (any CUDA build) on the GPU host first.
"""

from __future__ import annotations

import argparse
import sys

from admission.nodes.gpu import NvmlReader
from admission.nodes.memory import effective_fraction
from admission.nodes.watermarks import DOWN, DRAIN, HOLD, OPEN, next_state
from admission.policy import Watermarks


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--hold", type=float, default=0.80)
    ap.add_argument("--drain", type=float, default=0.85)
    a = ap.parse_args()
    wm = Watermarks(hold=a.hold, drain=a.drain, reopen=a.hold - 0.05)
    reader = NvmlReader()
    if not reader.available:
        print("NVML not available: run this on a GPU host")
        return 2
    import torch

    print(
        f"NVML: {reader.device_count()} device(s); torch {torch.__version__}, cuda {torch.cuda.is_available()}"
    )
    mem = reader.read_sync((a.device,))
    assert mem is not None
    print(
        f"device {a.device}: used {mem.used_bytes / 2**30:.2f} GiB of {mem.total_bytes / 2**30:.2f} GiB"
    )
    # The same card addressed by UUID ("GPU-…"), as a policy names a MIG instance ("MIG-…"):
    # the reader must give the same reading either way.
    uuid = reader._nvml.nvmlDeviceGetUUID(reader._nvml.nvmlDeviceGetHandleByIndex(a.device))
    uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    by_uuid = reader.read_sync((uuid,))
    assert by_uuid is not None and by_uuid.total_bytes == mem.total_bytes, (uuid, by_uuid)
    print(f"by UUID {uuid}: total {by_uuid.total_bytes / 2**30:.2f} GiB (same card)")
    state, seen = DOWN, []
    blocks = []
    step = max(1 << 28, mem.total_bytes // 50)  # ~2% of the card per step
    while True:
        mem = reader.read_sync((a.device,))
        assert mem is not None
        frac = effective_fraction("nvml", mem, None, None)
        state = next_state(state, frac, wm)
        if not seen or seen[-1] != state:
            seen.append(state)
        print(f"used {mem.used_bytes / 2**30:7.2f} GiB  fraction {frac:.3f}  state {state}")
        if frac >= wm.drain + 0.02 or mem.total_bytes - mem.used_bytes < 2 * step:
            break
        blocks.append(torch.empty(step, dtype=torch.uint8, device=f"cuda:{a.device}"))
        torch.cuda.synchronize()
    blocks.clear()
    torch.cuda.empty_cache()
    mem = reader.read_sync((a.device,))
    assert mem is not None
    frac = effective_fraction("nvml", mem, None, None)
    state = next_state(state, frac, wm)
    seen.append(state)
    print(f"freed: used {mem.used_bytes / 2**30:.2f} GiB  fraction {frac:.3f}  state {state}")
    print("states seen:", " → ".join(seen))
    reader.close()
    ok = HOLD in seen and DRAIN in seen and seen[-1] == OPEN
    print("PASS" if ok else "FAIL: expected open → hold → drain → open")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
