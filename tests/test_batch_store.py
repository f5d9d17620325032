"""Batch storage on a real redis-server: files in parts with a line index, outputs written part
by part, the sweep going on past a failing batch. `check_store` runs on the 3-master Redis
Cluster too (tests/test_cluster.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from admission.batch.lines import Lines
from admission.batch.store import BatchStore, PartWriter
from admission.batch.worker import Worker
from admission.errors import BackendUnavailable, BadRequest
from admission.policy import parse_policy
from admission.store import keys
from tests.conftest import BASE_POLICY

PART = 1000  # bytes per part here, so that a small file spans many


def line(i: int) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": f"line {i} " + "x" * (i % 90)}]}
    return (
        json.dumps(
            {"custom_id": f"c-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        ).encode()
        + b"\n"
    )


async def put_input(st: BatchStore, tenant: str, fid: str, n: int) -> bytes:
    data = b"".join(line(i) for i in range(n))
    lines = Lines(1000)
    w = PartWriter(st, tenant, fid)
    for k in range(0, len(data), 333):  # chunks that cut lines anywhere
        await w.write(data[k : k + 333])
        lines.feed(data[k : k + 333])
    lines.feed(b"", final=True)
    await w.close()
    meta = {
        "filename": "in.jsonl",
        "bytes": w.size,
        "purpose": "batch",
        "created_at": 1,
        "expires_at": 4_000_000_000,
        "parts": w.parts,
        "lines": lines.count,
        "urls": ",".join(lines.urls),
    }
    await st.commit_file(tenant, fid, meta, bytes(lines.index))
    return data


async def check_store(redis: Any) -> None:
    st = BatchStore(redis, part_bytes=PART)
    data = await put_input(st, "t1", "file-in", 60)
    meta = await st.file_meta("t1", "file-in")
    assert meta is not None and int(meta["parts"]) == -(-len(data) // PART) > 3
    assert b"".join([p async for p in st.file_parts("t1", "file-in", int(meta["parts"]))]) == data
    for i in range(60):  # every line, across part boundaries, by its offsets
        assert await st.line("t1", "file-in", i) == line(i).rstrip(b"\n")
    assert await st.file_meta("t2", "file-in") is None  # another tenant's keys
    fields = {
        "tenant": "t1",
        "status": "in_progress",
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file-in",
        "created_at": 1,
        "expires_at": 4_000_000_000,
        "total": 60,
        "completed": 0,
        "failed": 0,
        "queued": 0,
    }
    assert await st.create("t1", "batch_a", fields, meta, max_open=1) == 1
    assert await st.create("t1", "batch_b", fields, meta, max_open=1) == 0  # one open at most
    await st.enqueue("t1", "batch_a", 60)
    assert (await st.get("t1", "batch_a") or {})["queued"] == "60"
    for i in range(60):
        answer = {"custom_id": f"c-{i}", "response": {"body": "y" * 200}, "error": None}
        await st.record("t1", "batch_a", i, answer, i % 7 != 0, int(time.time()) + 60)
    assert (await st.record("t1", "batch_a", 0, {}, True, int(time.time()) + 60))[0] is False
    policy = parse_policy(BASE_POLICY.replace("REDIS_URL", "redis://127.0.0.1:1/0"))
    w = Worker(redis, lambda: policy, "/nonexistent.sock")
    w.store = st
    await w.finalize("t1", "batch_a")
    b = await st.get("t1", "batch_a") or {}
    assert b["status"] == "completed" and await st.open_batches() == {}
    out = await st.file_meta("t1", b["output_file_id"])
    assert out is not None and int(out["parts"]) > 5  # written part by part
    for n in range(int(out["parts"])):
        assert len(await redis.get(keys.batch_file_part("t1", b["output_file_id"], n))) <= PART
    got = b"".join([p async for p in st.file_parts("t1", b["output_file_id"], int(out["parts"]))])
    ids = [json.loads(x)["custom_id"] for x in got.splitlines()]
    assert ids == [f"c-{i}" for i in range(60) if i % 7 != 0]  # input order
    assert await st.delete_file("t1", "file-in") == 1  # its batch is over
    assert await st.line("t1", "file-in", 0) is None


async def test_files_in_parts_lines_by_index_outputs_by_part(redis: Any) -> None:
    await check_store(redis)


async def test_a_batch_that_fails_to_finalize_does_not_stop_the_sweep(redis: Any) -> None:
    st = BatchStore(redis, part_bytes=PART)
    policy = parse_policy(BASE_POLICY.replace("REDIS_URL", "redis://127.0.0.1:1/0"))
    w = Worker(redis, lambda: policy, "/nonexistent.sock")
    w.store = st
    done: list[str] = []

    async def finalize(tenant: str, bid: str) -> None:
        if bid == "batch_bad":
            raise RuntimeError("output too large")
        done.append(bid)

    w.finalize = finalize  # type: ignore[method-assign]
    await w.store.ensure_group()
    for bid in ("batch_bad", "batch_good"):
        await redis.hset(keys.batch("t", bid), mapping={"total": 1, "completed": 1, "queued": 1})
        await redis.hset(keys.BATCHES_OPEN, bid, "t")
    await w.sweep()
    assert done == ["batch_good"]


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b'{"custom_id": "a"}\n', "line 1: method must be POST"),
        (line(0) + b"\n\n" + line(0), "line 4: custom_id 'c-0' repeats"),
        (line(0) + b"\xff\n", "line 2: not UTF-8"),
        (b"\n \n", "file has no requests"),
    ],
)
def test_lines_name_the_first_bad_one(data: bytes, problem: str) -> None:
    lines = Lines(10)
    with pytest.raises(BadRequest) as ei:
        lines.feed(data[:5])
        lines.feed(data[5:], final=True)
    assert problem in ei.value.message


def test_line_separators_inside_json_strings_are_not_line_ends() -> None:
    raw = json.dumps(
        {"custom_id": "a\u2028b\u0085", "method": "POST", "url": "/v1/completions", "body": {}},
        ensure_ascii=False,
    ).encode()
    lines = Lines(10)
    lines.feed(raw + b"\r\n" + line(1), final=True)
    assert lines.count == 2 and lines.n == 2


async def test_storage_down_is_a_503_with_a_reason() -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError

    from admission.batch.api import _storage_guard

    async def handler(_request: Any) -> Any:
        raise RedisConnectionError("Connection refused")

    with pytest.raises(BackendUnavailable) as ei:
        await _storage_guard(handler)(None)  # type: ignore[arg-type]
    assert ei.value.code == "batch_storage_unavailable"
