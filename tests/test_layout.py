"""The layout holds: the product imports none of the development packages, no two top-level
packages import each other, and no module outgrows one screenful of responsibility."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

TOPS = ("admission", "devstack", "engine", "loadtest", "tests")


def imports() -> dict[str, set[str]]:
    deps: dict[str, set[str]] = defaultdict(set)
    for top in TOPS:
        for f in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for n in names:
                    if (t := n.split(".")[0]) in TOPS and t != top:
                        deps[top].add(t)
    return deps


def test_product_imports_no_development_package() -> None:
    assert imports()["admission"] == set()


def test_no_import_cycle_between_top_level_packages() -> None:
    deps = imports()
    for a, targets in deps.items():
        for b in targets:
            assert a not in deps.get(b, set()), f"{a} <-> {b}"
    assert "tests" not in {t for ts in deps.values() for t in ts}


def test_no_module_over_400_lines() -> None:
    big = [
        (str(f.relative_to(ROOT)), n)
        for top in ("admission", "devstack", "engine", "loadtest")
        for f in (ROOT / top).rglob("*.py")
        if (n := len(Path(f).read_text().splitlines())) > 400
    ]
    assert big == []


def test_the_limiter_knows_nothing_of_scheduling() -> None:
    # Tenant limits are a layer below the dispatcher: it composes the limiter's calls with its
    # own lease (scheduling/trip.py); the limiter neither imports scheduling nor takes a
    # companion call to carry.
    src = "\n".join(f.read_text() for f in (ROOT / "admission" / "limits").rglob("*.py"))
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert not node.module.startswith("admission.scheduling"), node.module
        if isinstance(node, ast.arg):
            assert node.arg not in ("also", "lease", "give_back", "ticket"), node.arg
