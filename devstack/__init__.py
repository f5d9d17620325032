"""The local development stack: every process of `admission up` (Redis, engine nodes, agent,
sidecars, NGINX) started and stopped in order, and the process helpers tests and benchmarks use.
Not part of the product: nothing under `admission/` imports it."""
