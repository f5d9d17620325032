"""The benchmark's parts: the systems it fronts the nodes with, the driver that sends a
workload and records what came back, the report, and the helpers they share."""
