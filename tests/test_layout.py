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
    # own lease (scheduling/round_trip.py); the limiter neither imports scheduling nor takes a
    # companion call to carry.
    src = "\n".join(f.read_text() for f in (ROOT / "admission" / "limits").rglob("*.py"))
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert not node.module.startswith("admission.scheduling"), node.module
        if isinstance(node, ast.arg):
            assert node.arg not in ("also", "lease", "give_back", "ticket"), node.arg


def module_graph(*tops: str) -> dict[str, set[str]]:
    """Module → the modules it imports (type-only imports too), within `tops`. `from pkg import
    name` is an edge to pkg.name when that is a module, else to pkg."""
    files = {}
    for top in tops:
        for f in (ROOT / top).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = f
    graph: dict[str, set[str]] = {m: set() for m in files}
    for m, f in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                    for a in node.names
                ]
            else:
                continue
            graph[m] |= {t for t in targets if t in files and t != m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_modules() -> None:
    """Not between any two modules of the product, the dev stack, the engine or loadtest,
    type-only imports included: a module that needs another's type takes it as a collaborator
    (scheduling/running.py's Loop, scheduling/release.py's Releases), not a back-reference."""
    assert cycles(module_graph("admission", "devstack", "engine", "loadtest")) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_only_the_package_face_imports_the_dispatcher() -> None:
    graph = module_graph("admission")
    users = {m for m, deps in graph.items() if "admission.scheduling.dispatcher" in deps}
    assert users == {"admission.scheduling"}


# The scheduling rules: pure (no asyncio, Redis or aiohttp), time passed in. The cluster side
# (nodetable, refresh_reads, shares, head_locations, leases, round_trip, answer_ahead,
# take_lease, release, running, dispatcher) is what talks to Redis.
RULES = (
    "overload",
    "queue",
    "priority",
    "answer_lengths",
    "shedding",
    "late_heads",
    "routing",
    "candidates",
    "views",
    "prefixes",
    "ask",
    "ticket",
    "gauges",
    "demand",
)


def test_the_scheduling_rules_import_no_asyncio_redis_or_aiohttp() -> None:
    import subprocess
    import sys

    for rule in RULES:
        probe = (
            f"import sys; import admission.scheduling.{rule}; "
            "print(sorted({'asyncio', 'redis', 'aiohttp'} & set(sys.modules)))"
        )
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
        )
        assert out.stdout.strip() == "[]", (rule, out.stdout)


# Functions that are tables: one entry per line (arguments, metrics, manifest objects).
TABLES = {
    "admission/cli.py:build_parser",
    "admission/metrics.py:__init__",
    "admission/kubernetes/edge.py:edge",
    "admission/kubernetes/nodes.py:vllm",
}


def test_no_function_of_the_product_over_60_lines_but_tables() -> None:
    long = sorted(
        f"{f.relative_to(ROOT)}:{n.name}"
        for f in (ROOT / "admission").rglob("*.py")
        for n in ast.walk(ast.parse(f.read_text()))
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and n.end_lineno is not None
        and n.end_lineno - n.lineno + 1 > 60
    )
    assert set(long) == TABLES, set(long) ^ TABLES


def test_a_product_module_over_350_lines_says_why_it_is_one_job() -> None:
    silent = [
        str(f.relative_to(ROOT))
        for f in (ROOT / "admission").rglob("*.py")
        if len(f.read_text().splitlines()) > 350
        and "One job over 350 lines" not in (ast.get_docstring(ast.parse(f.read_text())) or "")
    ]
    assert silent == []


def test_routing_takes_at_most_8_parameters() -> None:
    from admission.scheduling import gates, routing

    for fn in (routing.eligible, gates.ask_for, gates.why_not):
        code = fn.__code__
        assert code.co_argcount + code.co_kwonlyargcount <= 8, fn.__name__
