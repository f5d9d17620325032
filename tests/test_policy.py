"""Policy loading: every problem reported with its path (and line), `admission check`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from admission.errors import PolicyError
from admission.policy import digest_key, load_policy, parse_policy
from devstack.stack import DEFAULT_POLICY
from tests.conftest import BASE_POLICY as _BASE
from tests.conftest import ROOT

BASE_POLICY = _BASE.replace("REDIS_URL", "redis://127.0.0.1:6379/0")


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as ei:
        parse_policy(text)
    return ei.value.problems


def test_repository_policy_is_valid() -> None:
    p = load_policy(DEFAULT_POLICY)
    assert list(p.classes) == ["realtime", "batch", "offline"]
    assert {t.id: t.weight for t in p.tenants.values()}["acme"] == 5
    assert p.key_index[digest_key("sk-demo-acme")] == "acme"


def test_every_problem_is_reported_with_path_and_line() -> None:
    bad = (
        BASE_POLICY.replace("hold: 0.8,", "hold: 0.9,")
        .replace("weight: 8,", "weight: 0,")
        .replace("max_inflight: 4}", "max_inflight: -1, colour: red}")
        .replace("requests_per_s: 10,", "requests_per_s: -5,")
        .replace("tokens_per_min: 600,", "tokens_per_min: lots,")
    )
    got = problems(bad)
    text = "\n".join(got)
    assert "watermarks.hold (line 4): must be below drain (0.85), got 0.9" in text
    assert "classes.realtime.weight (line 6): must be > 0, got 0" in text
    assert "nodes.n1.colour (line 21): unknown key" in text
    assert "nodes.n1.max_inflight (line 21): must be >= 1, got -1" in text
    assert "tenants.acme.limits.requests_per_s" in text and "got -5" in text
    assert "tenants.small.limits.tokens_per_min" in text and "must be a number" in text
    assert len(got) == 6


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "classes: [realtime]\n",
            "classes: [realtime]\n    default_class: batch\n",
            "tenants.small.default_class (line 19): 'batch' is not in the tenant's classes",
        ),
        (
            '"plain:sk-small"',
            '"plain:sk-acme"',
            "tenants.small.keys[0] (line 17): key already belongs to tenant acme",
        ),
        (
            "  small:\n    weight: 1\n",
            "  small:\n    tier: diamond\n",
            "tenants.small.tier (line 16): unknown tier 'diamond'",
        ),
        (
            "classes: [realtime]\n",
            "classes: [realtime, vip]\n",
            "tenants.small.classes[1] (line 18): unknown class 'vip'",
        ),
        ("reopen: 0.75", "reopen: 0.8", "watermarks.reopen (line 4): must be below hold"),
        (
            "stale_after_s: 2}",
            "stale_after_s: 2, projection_window_s: 2}",
            "watermarks.projection_window_s (line 4): removed: each node's ledger in Redis",
        ),
        (
            "stale_after_s: 2}",
            "stale_after_s: 2, max_engine_waiting: 2}",
            "watermarks.max_engine_waiting (line 4): removed: the prefill budget",
        ),
        (
            "promote_after_s: 2}",
            "promote_after_s: 2, on_late: drop}",
            "classes.batch.on_late (line 7): must be one of serve, refuse, got 'drop'",
        ),
        (
            '"plain:sk-small"',
            '"sha256:abc"',
            "tenants.small.keys[0] (line 17): sha256 digest must be 64 hex",
        ),
        ("version: 1", "version: 1\nbogus: true", "bogus (line 3): unknown key"),
        ("priority: 1,", "priority: 0,", "classes (line 5): priority values must be distinct"),
        ("models: [m]", "models: []", "nodes.n1.models (line 21): must list at least one model"),
        (  # the edge waits 660 s for an admission answer: a longer wait could not be served
            "priority: 0, deadline_s: 5}",
            "priority: 0, deadline_s: 601}",
            "classes.realtime.deadline_s (line 6): must be <= 600, got 601",
        ),
        (
            "version: 1",
            "version: 1\nqueue: {lease_ttl_s: 100000}",
            "queue.lease_ttl_s (line 3): must be <= 86400, got 100000",
        ),
        (
            'url: "http://127.0.0.1:1"',
            'url: "ftp://x"',
            "nodes.n1.url (line 21): must start with one of http://",
        ),
    ],
)
def test_specific_errors(old: str, new: str, expected: str) -> None:
    assert old in BASE_POLICY
    got = problems(BASE_POLICY.replace(old, new, 1))
    assert any(expected in p for p in got), got


def test_duplicate_tenant_ids_are_a_yaml_error_we_report() -> None:
    extra = "  acme:\n    keys: ['plain:x']\n    limits: {requests_per_s: 1, tokens_per_min: 1}\nnodes:\n"
    dup = BASE_POLICY.replace("nodes:\n", extra)
    # PyYAML keeps the last duplicate silently; we refuse the file instead.
    got = problems(dup)
    assert "tenants.acme (line 20): duplicate key" in got, got


def test_invalid_yaml_and_wrong_top_level_type() -> None:
    assert "not valid YAML (line 2)" in problems("a: [1\nb: 2")[0]
    assert problems("[1, 2]") == ["<root> (line 1): must be a mapping, got list"]
    assert problems("") == ["<root>: file is empty"]


def test_plaintext_key_is_never_in_errors_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    got = problems(BASE_POLICY.replace("weight: 8,", "weight: 0,"))
    assert not any("sk-acme" in p for p in got)
    parse_policy(BASE_POLICY)
    assert "plaintext" in caplog.text and "sk-acme" not in caplog.text


def test_check_command(tmp_path: Path) -> None:
    good = subprocess.run(
        [sys.executable, "-m", "admission.cli", "check", str(DEFAULT_POLICY)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert good.returncode == 0 and good.stdout.startswith("ok:")
    bad_file = tmp_path / "p.yaml"
    bad_file.write_text(
        BASE_POLICY.replace("hold: 0.8,", "hold: 0.9,").replace("weight: 8,", "weight: 0,")
    )
    bad = subprocess.run(
        [sys.executable, "-m", "admission.cli", "check", str(bad_file)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert bad.returncode == 1
    assert bad.stdout.splitlines() == [
        "watermarks.hold (line 4): must be below drain (0.85), got 0.9",
        "classes.realtime.weight (line 6): must be > 0, got 0",
    ]
    missing = subprocess.run(
        [sys.executable, "-m", "admission.cli", "check", str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert missing.returncode == 1 and "cannot read" in missing.stdout


def test_invalid_utf8_is_a_policy_error_not_a_crash(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_bytes(_BASE.replace("REDIS_URL", "redis://h:1/0").encode() + b"\n# \xff plain:sk-x\n")
    with pytest.raises(PolicyError) as ei:
        load_policy(f)
    assert "not UTF-8" in ei.value.problems[0] and "sk-x" not in str(ei.value)


def test_a_failing_listener_does_not_stop_the_others(tmp_path: Path) -> None:
    from admission.metrics import Metrics
    from admission.reload import PolicyHolder

    f = tmp_path / "p.yaml"
    base = _BASE.replace("REDIS_URL", "redis://127.0.0.1:1/0")
    f.write_text(base)
    holder = PolicyHolder(f, load_policy(f), Metrics())
    seen: list[object] = []

    def broken(_p: object) -> None:
        raise OSError("disk full")

    holder.listeners += [broken, seen.append]
    f.write_text(base.replace("deadline_s: 5", "deadline_s: 6"))
    assert holder.reload()
    assert seen == [holder.current] and holder.current.classes["realtime"].deadline_s == 6


def test_errors_never_echo_secrets() -> None:
    # A YAML error on a line holding a key names the problem and the line, not the line's text.
    got = problems(BASE_POLICY.replace('keys: ["plain:sk-acme"]', 'keys: ["plain:sk-acme"]]'))
    assert got and not any("sk-acme" in p for p in got)
    # A bare key typed where a value was due (found by `make fuzz`: "weight: must be a number,
    # got 'sk-demo-hobbyist'"), as a value or as a mapping key, is never printed.
    # (A mapping key is printed in the path, unless it is an `sk-` key.)
    for bad in ("sk-live-0123abcd", "Zx81kQ0pL2mN7vB4tY6w"):
        got = problems(BASE_POLICY.replace("weight: 8,", f"weight: {bad},", 1))
        assert got and not any(bad in p for p in got), got
    got = problems(BASE_POLICY.replace("  acme:\n", "  acme:\n    sk-live-0123abcd: 1\n", 1))
    assert got and not any("sk-live-0123abcd" in p for p in got), got
    # A Redis URL with a password is redacted where it is echoed.
    got = problems(BASE_POLICY.replace("redis://127.0.0.1:6379/0", "http://:hunter2@db:6379/0"))
    assert any("redis.url" in p and "***" in p for p in got)
    assert not any("hunter2" in p for p in got)


def test_check_diff_says_what_a_change_means(tmp_path: Path) -> None:
    base = _BASE.replace("REDIS_URL", "redis://127.0.0.1:1/0")
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(base)
    new.write_text(
        base.replace("requests_per_s: 10,", "requests_per_s: 15,")
        .replace("realtime: {weight: 8,", "realtime: {weight: 4,")
        .replace("  small:\n    weight: 1\n", "  small:\n    weight: 1\n    shadow: true\n")
    )
    out = subprocess.run(
        [sys.executable, "-m", "admission.cli", "check", "--diff", str(old), str(new)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "tenant acme: limit requests_per_s raised 50% (10 → 15)" in lines
    assert "class realtime: weight lowered 50% (8 → 4)" in lines
    assert "tenant small: limits shadowed (not enforced)" in lines
    same = subprocess.run(
        [sys.executable, "-m", "admission.cli", "check", "--diff", str(old), str(old)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert same.stdout.strip() == "no change in meaning"


async def test_a_configmap_update_reloads_the_policy(tmp_path: Path) -> None:
    """A Kubernetes ConfigMap volume: `policies.yaml` → `..data/policies.yaml`, `..data` → a
    timestamped directory; an update writes a new directory, swaps `..data` by rename and deletes
    the old one. The watcher sees it (it watched the deleted directory before)."""
    import asyncio

    from admission.metrics import Metrics
    from admission.reload import PolicyHolder

    base = _BASE.replace("REDIS_URL", "redis://127.0.0.1:1/0")

    def version(name: str, text: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "policies.yaml").write_text(text)
        (tmp_path / "..data_tmp").symlink_to(name)
        (tmp_path / "..data_tmp").rename(tmp_path / "..data")

    version("..2026_12_07_a", base)
    f = tmp_path / "policies.yaml"
    f.symlink_to("..data/policies.yaml")
    holder = PolicyHolder(f, load_policy(f), Metrics())
    watching = asyncio.create_task(holder.watch())
    try:
        await asyncio.sleep(0.5)
        # Twice: the first swap deletes the directory the policy first resolved to.
        for old, new, deadline in (("a", "b", 7), ("b", "c", 9)):
            version(f"..2026_12_07_{new}", base.replace("deadline_s: 5", f"deadline_s: {deadline}"))
            for gone in (tmp_path / f"..2026_12_07_{old}").iterdir():
                gone.unlink()
            (tmp_path / f"..2026_12_07_{old}").rmdir()
            for _ in range(50):
                if holder.current.classes["realtime"].deadline_s == deadline:
                    break
                await asyncio.sleep(0.1)
            assert holder.current.classes["realtime"].deadline_s == deadline
    finally:
        watching.cancel()
