"""README.md and docs/ point at what exists: every relative link resolves, every repository
path they name in backticks exists (and every `tests/…::test_name` is a test there), and
nothing points outside the repository (the team's shared/ notes are not shipped)."""

from __future__ import annotations

import re

from tests.conftest import ROOT

DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "decisions").glob("*.md")),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(
    r"`((?:admission|engine|devstack|loadtest|tests|docs|scripts)/[\w./@-]+?\.(?:py|lua|md|conf|"
    r"yaml|template|json|service|sh|png))(?:::([\w\[\]-]+))?`"
)


def test_relative_links_resolve() -> None:
    bad = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:|#", target):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                bad.append(f"{doc.name}: {target}")
    assert not bad, bad


def test_named_paths_and_tests_exist() -> None:
    bad = []
    for doc in DOCS:
        text = doc.read_text()
        for path, test in PATH.findall(text):
            f = ROOT / path
            if not f.exists():
                bad.append(f"{doc.name}: {path}")
            elif test and not re.search(rf"def {re.escape(test.split('[')[0])}\b", f.read_text()):
                bad.append(f"{doc.name}: {path}::{test}")
        if "shared/" in text:
            bad.append(f"{doc.name}: names shared/ (not in the repository)")
    assert not bad, bad


def test_the_front_page_is_short() -> None:
    """README.md is what a first-time user reads: at most 200 lines; the rest lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_docs_show_the_present_in_their_sizes() -> None:
    """The architecture is a map (the decisions are records of their own), the benchmarks page
    holds today's figures (their history is in git), and each decision is short."""
    lines = {d.relative_to(ROOT).as_posix(): len(d.read_text().splitlines()) for d in DOCS}
    assert lines["docs/architecture.md"] <= 350
    assert lines["docs/benchmarks.md"] <= 500
    records = {d: n for d, n in lines.items() if d.startswith("docs/decisions/")}
    assert len(records) >= 10 and max(records.values()) <= 40, records
    listed = (ROOT / "docs" / "architecture.md").read_text()
    assert all(d.removeprefix("docs/") in listed for d in records), "a record not on the map"
