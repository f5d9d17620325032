"""Nodes: the agent → sidecar contract (NodeState), memory sources as a registry, the watermark
state machine, GPU readers (NVML, simulated) and the node agent that publishes them."""

from admission.nodes.gpu import GpuMemory, GpuReader, NvmlReader, SimulatedGpuReader
from admission.nodes.memory import SOURCES, effective_fraction
from admission.nodes.state import NodeState, Status
from admission.nodes.watermarks import next_state

__all__ = [
    "SOURCES",
    "GpuMemory",
    "GpuReader",
    "NodeState",
    "NvmlReader",
    "SimulatedGpuReader",
    "Status",
    "effective_fraction",
    "next_state",
]
