"""Workloads: the mixes (`*.yaml` here) and their model, and the prompts they send."""
