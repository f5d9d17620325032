"""The benchmark's own parts an SRE relies on: a YAML workload, and the engine-only baseline's
admission valves (vLLM 0.32's --max-num-queued-tokens / -reqs) in the emulator."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.emulator import Engine
from engine.profiles import PROFILES
from engine.scheduler import Seq
from loadtest.workload import load_kinds, schedule


def test_workload_file_defines_the_mix(tmp_path: Path) -> None:
    f = tmp_path / "mix.yaml"
    f.write_text(
        "kinds:\n"
        "  - {name: rag, class: realtime, tenants: [acme], share: 1.0,\n"
        "     prompt_tokens: [3000, 3000], output_tokens: [20, 20]}\n"
    )
    kinds = load_kinds(str(f))
    reqs = schedule(10, 5, seed=1, kinds=kinds)
    assert reqs and all(r.kind == "rag" and r.prompt_tokens == 3000 for r in reqs)
    f.write_text("kinds:\n  - {name: x}\n")
    with pytest.raises(SystemExit, match="kinds\\[0\\]"):
        load_kinds(str(f))


async def test_queued_tokens_valve_sheds_instead_of_queueing() -> None:
    e = Engine(PROFILES["tiny"], max_queued_tokens=1000)
    e.submit(Seq(600, 10))
    with pytest.raises(OverflowError, match="max_num_queued_tokens"):
        e.submit(Seq(600, 10))  # 1,200 prompt tokens would wait: refused
    e.submit(Seq(300, 10))
    r = Engine(PROFILES["tiny"], max_queued_reqs=1)
    r.submit(Seq(10, 10))
    with pytest.raises(OverflowError, match="max_num_queued_reqs"):
        r.submit(Seq(10, 10))
