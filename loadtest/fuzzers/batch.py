"""Fuzzing the Batch API through the real edge: files and batches.

Hypothesis draws operations — uploads of files whose lines are valid, nearly valid or junk
(encodings: UTF-8, UTF-16, Latin-1, a BOM; separators \\n, \\r\\n, U+2028 inside strings;
empty, duplicated and oversized lines; purposes and `expires_after` right and wrong), and
retrieve, content, delete, create, cancel and list calls on ids that exist, belong to another
tenant, or cannot be ids (`:`, `%2F`, dot segments, 300 characters) — and sends them as two
tenants. Every answer must be defined: 2xx, or an OpenAI-shaped JSON error, a 5xx only with a
documented code. Afterwards (in loadtest.fuzz): no traceback or Lua error in any log, every
sidecar healthy, nothing left booked, no tenant over its file quota.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from hypothesis import given
from hypothesis import strategies as st

from loadtest.fuzzers import drawn
from loadtest.fuzzers.checks import Case, Tally, check

KEYS = ("sk-demo-etl", "sk-demo-acme")


@dataclass(frozen=True)
class Op:
    method: str
    path: str
    key: str
    form: tuple[bytes, str, tuple[tuple[str, str], ...]] | None = None  # file, purpose, fields
    body: bytes | None = None


def _line(cid: str, text: str, ascii_only: bool) -> bytes:
    doc = {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "llama-3-8b",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": text}],
        },
    }
    return json.dumps(doc, ensure_ascii=ascii_only).encode()


text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
line = st.one_of(
    st.builds(_line, st.from_regex(r"[a-z0-9-]{1,12}", fullmatch=True), text, st.booleans()),
    st.builds(_line, st.just("dup"), st.just("same id twice"), st.just(True)),
    st.builds(lambda t: _line("sep", "a\u2028b\u0085" + t, False), text),
    st.binary(max_size=60),
    st.just(b""),
    st.just(b'{"custom_id": "x", "method": "GET", "url": "/v1/embeddings", "body": {}}'),
    st.just(b"[1, 2]"),
)
separator = st.sampled_from([b"\n", b"\n", b"\r\n", "\u2028".encode()])
encoding = st.sampled_from(["utf-8"] * 6 + ["utf-16", "latin-1", "bom"])


def _file(lines: list[bytes], sep: bytes, enc: str, big: bool) -> bytes:
    data = sep.join(lines) + (b"x" * 450_000 if big else b"")
    if enc == "bom":
        return b"\xef\xbb\xbf" + data
    if enc != "utf-8":
        return data.decode("utf-8", errors="replace").encode(enc, errors="replace")
    return data


files = st.builds(
    _file, st.lists(line, max_size=12), separator, encoding, st.sampled_from([False] * 15 + [True])
)
expires = st.one_of(
    st.just(()),
    st.tuples(
        st.tuples(st.just("expires_after[anchor]"), st.sampled_from(["created_at", "now", ""])),
        st.tuples(
            st.just("expires_after[seconds]"),
            st.sampled_from(["3600", "86400", "59", "99999999", "soon", "-1"]),
        ),
    ),
)
bad_ids = st.sampled_from(
    [
        "file-x:data",
        "file-x%2Fdata",
        "..",
        "%2e%2e",
        "x" * 300,
        "batch_:res",
        "file-" + "0" * 24,
        "batch_" + "0" * 24,
    ]
)


class Ids:
    """Ids the API handed out during the run (drawn from, so calls hit real objects too)."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.batches: list[str] = []

    def pick(self, kind: str, r: random.Random, bad: str) -> str:
        pool = self.files if kind == "file" else self.batches
        return r.choice(pool) if pool and r.random() < 0.7 else bad


def ops(ids: Ids) -> st.SearchStrategy[Op]:
    def build(
        kind: int,
        data: bytes,
        purpose: str,
        fields: Any,
        bad: str,
        key: str,
        seed: int,
        junk: bytes,
    ) -> Op:
        r = random.Random(seed)
        fid, bid = ids.pick("file", r, bad), ids.pick("batch", r, bad)
        if kind == 0:
            return Op("POST", "/v1/files", key, form=(data, purpose, tuple(fields)))
        if kind == 1:
            return Op(
                "GET",
                r.choice(
                    [
                        f"/v1/files/{fid}",
                        f"/v1/files/{fid}/content",
                        "/v1/files",
                        "/v1/files?purpose=batch",
                    ]
                ),
                key,
            )
        if kind == 2:
            return Op("DELETE", f"/v1/files/{fid}", key)
        if kind == 3:
            body = {
                "input_file_id": fid,
                "endpoint": r.choice(["/v1/chat/completions", "/v1/x"]),
                "completion_window": r.choice(["24h", "24h", "1h"]),
                "metadata": r.choice([None, {"k": "v"}, "m"]),
            }
            raw = json.dumps(body).encode() if r.random() < 0.9 else junk
            return Op("POST", "/v1/batches", key, body=raw)
        if kind == 4:
            return Op("POST", f"/v1/batches/{bid}/cancel", key)
        return Op(
            "GET",
            r.choice(
                [
                    f"/v1/batches/{bid}",
                    "/v1/batches?limit=3",
                    f"/v1/batches?after={bid}",
                    "/v1/batches?limit=x",
                ]
            ),
            key,
        )

    return st.builds(
        build,
        st.sampled_from([0, 0, 0, 1, 1, 2, 3, 3, 4, 5]),
        files,
        st.sampled_from(["batch"] * 5 + ["fine-tune", ""]),
        expires,
        bad_ids,
        st.sampled_from(KEYS),
        st.integers(0, 2**32),
        st.binary(max_size=40),
    )


async def send(s: aiohttp.ClientSession, url: str, op: Op) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {op.key}"}
    if op.form is not None:
        data, purpose, fields = op.form
        form = aiohttp.FormData()
        form.add_field("purpose", purpose)
        for name, value in fields:
            form.add_field(name, value)
        form.add_field("file", data, filename="in.jsonl", content_type="application/jsonl")
        req = s.post(url + op.path, data=form, headers=headers)
    elif op.body is not None:
        req = s.post(
            url + op.path, data=op.body, headers={**headers, "Content-Type": "application/json"}
        )
    else:
        req = s.request(op.method, url + op.path, headers=headers)
    async with req as r:
        return r.status, await r.read()


def fuzz_batch(url: str, n_cases: int, tally: Tally) -> None:
    """`n_cases` drawn operations through the edge at `url`, one at a time; each answer judged
    by loadtest.fuzz's oracle (`check`) and counted in `tally`."""
    import asyncio

    ids = Ids()
    loop = asyncio.new_event_loop()
    session = loop.run_until_complete(_session())

    @drawn.cases(n_cases)
    @given(st.data())
    def run(data: st.DataObject) -> None:
        op = data.draw(ops(ids))
        t0 = time.monotonic()
        try:
            status, body = loop.run_until_complete(send(session, url, op))
        except (aiohttp.ClientError, TimeoutError) as exc:
            tally.statuses[0] += 1
            tally.failures.append(f"no answer ({exc!r}) for {op.method} {op.path}")
            return
        case = Case(op.path, (op.body or b"")[:200], {"Authorization": f"Bearer {op.key}"})
        code, failure = check(case, status, body)
        what = f"{op.method} {op.path}"
        tally.answered(
            status, time.monotonic() - t0, what, code, failure and f"{op.method} {failure}"
        )
        if status == 200 and op.method == "POST":
            doc = json.loads(body)
            (ids.files if doc.get("object") == "file" else ids.batches).append(doc["id"])

    try:
        run()
    finally:
        loop.run_until_complete(session.close())
        loop.close()


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
