"""Fitting the emulated engine to a real one: the probes sent to it
(`python -m loadtest.fit_engine`, `python -m loadtest.fidelity`)."""
