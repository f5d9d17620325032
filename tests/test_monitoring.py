"""The alert rules and the dashboard that ship with the product: `promtool check rules` and
`promtool test rules` with fixture series, and every expression names only metrics the
sidecar exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from admission.metrics import Metrics
from tests.conftest import ROOT

MON = Path(str(resources.files("admission") / "monitoring"))
BUILTIN = {"up"}  # Prometheus's own series
FUNCS = {
    "sum",
    "by",
    "rate",
    "max",
    "min",
    "histogram_quantile",
    "min_over_time",
    "increase",
    "ignoring",
    "group_left",
    "or",
    "le",
    "without",
    "on",
    "humanizePercentage",
}


def exported() -> set[str]:
    """Every series name a sidecar's /metrics carries (histograms as _bucket/_sum/_count)."""
    m = Metrics()
    m.decisions.labels("t", "realtime", "admitted", "ok").inc()
    m.queue_wait_seconds.labels("realtime").observe(0.1)
    m.decision_seconds.labels("realtime").observe(0.001)
    m.dispatch_seconds.observe(0.001)
    m.late_refused.labels("batch").inc()
    m.redis_errors.labels("acquire").inc()
    m.policy_reloads.labels("ok").inc()
    m.limit_factor.labels("m").set(1)
    m.settled_tokens.labels("t", "refund").inc()
    m.queue_depth.labels("realtime").set(1)
    m.node_state.labels("n", "open").set(1)
    m.model_nodes.labels("m").set(1)
    m.model_nodes_needed.labels("m").set(1)
    m.node_memory.labels("n").set(0.5)
    m.node_inflight.labels("n").set(1)
    m.gate[("n", "batch", "reserve")] += 1
    m.held[("batch", "reserve")] += 1
    text = generate_latest(m.registry).decode()
    return {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"
    }


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    labels = {
        "cls",
        "reason",
        "node",
        "state",
        "instance",
        "op",
        "result",
        "direction",
        "outcome",
        "model",
        "le",
    }
    return {w for w in words if w not in FUNCS and w not in labels}


def test_every_expression_names_an_exported_metric() -> None:
    have = exported() | BUILTIN
    rules = yaml.safe_load((MON / "alerts.yaml").read_text())["groups"][0]["rules"]
    dash = json.loads((MON / "dashboard.json").read_text())
    exprs = [r["expr"] for r in rules] + [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) > 20
    for e in exprs:
        missing = metric_names(e) - have
        assert not missing, (e, missing)
    for r in rules:
        assert r["annotations"]["runbook"] and r["annotations"]["summary"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian: prometheus)")
def test_promtool_checks_and_unit_tests_the_rules(tmp_path: Path) -> None:
    shutil.copy(MON / "alerts.yaml", tmp_path / "alerts.yaml")
    shutil.copy(ROOT / "tests" / "monitoring" / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    r = subprocess.run(
        ["promtool", "check", "rules", str(tmp_path / "alerts.yaml")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        ["promtool", "test", "rules", str(tmp_path / "alerts_test.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
