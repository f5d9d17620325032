"""GPU memory readers behind one interface: NVML on real GPUs, the emulator's simulated device.

`GpuReader.read(indices)` returns the summed memory of the given devices (a tensor-parallel node
uses several), or None when the reader has no such device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuMemory:
    """One reading of a GPU (or the sum over a tensor-parallel node's GPUs), in bytes."""

    used_bytes: int
    total_bytes: int


class GpuReader(Protocol):
    async def read(self, indices: tuple[int | str, ...]) -> GpuMemory | None: ...

    def close(self) -> None: ...


class NvmlReader:
    """Reads device memory through pynvml (nvidia-ml-py). `available` is False without NVML."""

    def __init__(self) -> None:
        self.available = False
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ... : no GPU here
            log.info("NVML not available (%s): GPU memory comes from the configured source", exc)
            return
        self._nvml = pynvml
        self.available = True

    def device_count(self) -> int:
        return int(self._nvml.nvmlDeviceGetCount()) if self.available else 0

    def read_sync(self, indices: tuple[int | str, ...]) -> GpuMemory | None:
        if not self.available:
            return None
        used = total = 0
        for i in indices:
            # An index, or a UUID: "GPU-…" for a whole card, "MIG-…" for a MIG instance (its
            # memory info is the instance's own).
            if isinstance(i, str):
                h = self._nvml.nvmlDeviceGetHandleByUUID(i)
            else:
                h = self._nvml.nvmlDeviceGetHandleByIndex(i)
            info = self._nvml.nvmlDeviceGetMemoryInfo(h)
            used += int(info.used)
            total += int(info.total)
        return GpuMemory(used, total)

    async def read(self, indices: tuple[int | str, ...]) -> GpuMemory | None:
        # nvmlDeviceGetMemoryInfo is a sub-millisecond ioctl: cheaper inline than a thread hop.
        return self.read_sync(indices)

    def close(self) -> None:
        if self.available:
            self._nvml.nvmlShutdown()
            self.available = False


class SimulatedGpuReader:
    """Reads the emulator's simulated device (`GET <device_url>` → used/total bytes)."""

    def __init__(self, session: aiohttp.ClientSession, device_url: str) -> None:
        self.session = session
        self.device_url = device_url

    async def read(self, indices: tuple[int | str, ...]) -> GpuMemory | None:
        async with self.session.get(self.device_url) as resp:
            resp.raise_for_status()
            body = await resp.json()
        return GpuMemory(int(body["used_bytes"]), int(body["total_bytes"]))

    def close(self) -> None:
        return None
