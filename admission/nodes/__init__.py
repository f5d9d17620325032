"""Nodes: the agent → sidecar contract (`state.NodeState`), memory sources as a registry
(`memory`), the watermark state machine (`watermarks`), GPU readers (`gpu`: NVML, simulated),
the change feed (`feed`) and the node agent that publishes them (`agent`). The face imports
none of them: `admission.nodes.state` alone loads no GPU reader, aiohttp or Redis."""
