"""The policy half of the fuzzer (loadtest/fuzz.py): mutated policies through the loader.

hypothesis mutates the shipped policies.yaml (lines deleted, duplicated, re-indented, values
replaced, text inserted, truncation, invalid UTF-8); `load_policy` must return a policy or
raise PolicyError, and no message may carry a `plain:` key.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from admission.errors import PolicyError
from admission.policy import load_policy
from loadtest.fuzzers import drawn

OPS = ("delete", "duplicate", "indent", "dedent", "replace_value", "insert", "truncate", "bad_utf8")


def mutate(text: str, ops: list[tuple[str, int, str]]) -> bytes:
    lines = text.split("\n")
    tail = b""
    for op, at, s in ops:
        i = at % max(1, len(lines))
        if op == "delete" and lines:
            del lines[i]
        elif op == "duplicate" and lines:
            lines.insert(i, lines[i])
        elif op == "indent" and lines:
            lines[i] = "  " + lines[i]
        elif op == "dedent" and lines:
            lines[i] = lines[i][2:]
        elif op == "replace_value" and lines and ":" in lines[i]:
            lines[i] = lines[i].split(":", 1)[0] + ": " + s
        elif op == "insert":
            lines.insert(i, s)
        elif op == "truncate":
            lines = lines[:i]
        elif op == "bad_utf8":
            tail = b"\xff\xfe" + s.encode()
    return "\n".join(lines).encode() + tail


yaml_scalar = st.sampled_from(
    [
        "",
        "~",
        "-1",
        "0",
        "1e309",
        "[a, b]",
        "{x: 1}",
        "'q'",
        "*a",
        "&a x",
        "!!python/object:os.system x",
        "true",
        "0.0001",
        "3",
        "{{",
        "\t",
        "'plain:sk-demo-acme'",
    ]
) | st.text(max_size=20)
mutations = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 10**6), yaml_scalar), min_size=1, max_size=4
)


@dataclass
class PolicyTally:
    valid: int = 0
    invalid: int = 0
    failures: list[str] = field(default_factory=list)


def fuzz_policy(n_cases: int, seed: int | None = None) -> PolicyTally:
    """`load_policy` on `n_cases` mutations of the shipped policy: a Policy or a PolicyError,
    never another exception, and no key in any message."""
    base = resources.files("admission").joinpath("policies.yaml").read_text()
    plain_keys = [
        k
        for w in base.split()
        if "plain:" in w
        if len(k := w.split("plain:", 1)[1].rstrip("\"']")) >= 8
    ]
    tally = PolicyTally()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "policies.yaml"

        @drawn.cases(n_cases, seed)
        @given(mutations)
        def run(ops: list[tuple[str, int, str]]) -> None:
            path.write_bytes(mutate(base, ops))
            try:
                load_policy(path)
                tally.valid += 1
            except PolicyError as exc:
                tally.invalid += 1
                text = "\n".join(exc.problems)
                if any(k and k in text for k in plain_keys):
                    tally.failures.append(f"a key in the error: {ops!r}")
            except Exception as exc:  # exactly what the fuzzer looks for
                tally.failures.append(f"{type(exc).__name__}: {exc} for {ops!r}")

        run()
    return tally


def report_policy(n_cases: int) -> list[str]:
    """`fuzz_policy`, its line printed; the failures."""
    t0 = time.monotonic()
    pt = fuzz_policy(n_cases)
    print(
        f"policy: {pt.valid + pt.invalid:,} mutations in {time.monotonic() - t0:.0f} s: "
        f"{pt.valid:,} valid, {pt.invalid:,} rejected with PolicyError; "
        f"{len(pt.failures)} failures",
        flush=True,
    )
    return pt.failures
