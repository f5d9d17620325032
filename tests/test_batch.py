"""The OpenAI Batch API through the real edge, driven by the official openai SDK: files and
batches scoped to the tenant, bounds with clear 4xx, cancellation, and every line answered
exactly once through kill -9 of the batch worker, of a sidecar and of Redis (AOF) mid-run."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from devstack.stack import Stack
from tests.conftest import started

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from started(
        tmp_path_factory,
        "batch",
        supervised=True,
        nodes=2,
        sidecars=2,
        batch_claim_idle_s=3.0,
        policy_overrides={
            "batch": {
                "max_file_bytes": 400_000,
                "max_open_per_tenant": 3,
                "max_files_per_tenant": 12,
                "max_stored_bytes_per_tenant": 1_000_000,
                "max_uploads_per_min": 20,
            }
        },
    )


def client(stack: Stack, key: str = "sk-demo-etl") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=2)


def jsonl(n: int, prefix: str = "req", max_tokens: int = 8) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "llama-3-8b",
                    "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": f"line {i}"}],
                },
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


def wait_done(c: openai.OpenAI, bid: str, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            b = c.batches.retrieve(bid)
        except openai.InternalServerError:  # Redis restarting under a kill test: ask again
            time.sleep(0.5)
            continue
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        time.sleep(0.5)
    raise AssertionError(f"batch {bid} still {b.status}: {b.request_counts}")


def answers(c: openai.OpenAI, b: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    out = (
        [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
        if b.output_file_id
        else []
    )
    err = (
        [json.loads(x) for x in c.files.content(b.error_file_id).text.splitlines()]
        if b.error_file_id
        else []
    )
    return out, err


def test_sdk_round_trip_every_line_answered_once(stack: Stack) -> None:
    c = client(stack)
    f = c.files.create(file=("in.jsonl", jsonl(40)), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0
    b = c.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert b.status == "in_progress" and b.request_counts.total == 40
    done = wait_done(c, b.id)
    assert done.status == "completed" and done.metadata == {"job": "nightly"}
    assert done.request_counts.completed == 40 and done.request_counts.failed == 0
    out, err = answers(c, done)
    assert err == [] and [o["custom_id"] for o in out] == [f"req-{i}" for i in range(40)]
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert b.id in [x.id for x in c.batches.list(limit=10).data]


def test_objects_are_scoped_to_their_tenant(stack: Stack) -> None:
    etl, acme = client(stack), client(stack, "sk-demo-acme")
    f = etl.files.create(file=("in.jsonl", jsonl(1)), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        acme.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        acme.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    b = etl.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with pytest.raises(openai.NotFoundError):
        acme.batches.retrieve(b.id)
    with pytest.raises(openai.AuthenticationError):
        client(stack, "sk-wrong").batches.list()
    wait_done(etl, b.id)


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\nnot json\n',
            400,
            "invalid_file",
        ),
        (jsonl(2) + jsonl(1), 400, "invalid_file"),  # custom_id repeats
        (jsonl(2300), 413, "file_too_large"),  # ~414 kB: over batch.max_file_bytes (the sidecar)
        (jsonl(4000), 413, "body_too_large"),  # ~722 kB: over NGINX's bound (its 413, as JSON)
    ],
)
def test_bad_files_get_clear_errors(stack: Stack, data: bytes, status: int, code: str) -> None:
    with pytest.raises(openai.APIStatusError) as ei:
        client(stack).files.create(file=("in.jsonl", data), purpose="batch")
    assert ei.value.status_code == status
    assert ei.value.body["code"] == code, ei.value.body  # type: ignore[index]


def test_cancel_and_open_batch_bound(stack: Stack) -> None:
    c = client(stack)
    f = c.files.create(file=("in.jsonl", jsonl(300, "slow", max_tokens=200)), purpose="batch")
    bids = [
        c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    with pytest.raises(openai.RateLimitError) as ei:  # max_open_per_tenant: 3
        c.with_options(max_retries=0).batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert ei.value.body["code"] == "too_many_open_batches"  # type: ignore[index]
    for bid in bids:
        assert c.batches.cancel(bid).status in ("cancelling", "completed")
    for bid in bids:
        done = wait_done(c, bid)
        assert done.status == "cancelled"
        out, err = answers(c, done)
        assert len(out) + len(err) == 300 == done.request_counts.total
        assert sum(e["error"]["code"] == "batch_cancelled" for e in err) > 0


def test_lines_answered_exactly_once_through_kills(stack: Stack) -> None:
    """kill -9 of the batch worker, of a sidecar and of redis-server (restarted from its AOF)
    while a batch runs: every line is answered, once."""
    c = client(stack)
    n = 300
    f = c.files.create(file=("in.jsonl", jsonl(n, "k", max_tokens=24)), purpose="batch")
    b = c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for name in ("batch-worker-0", "sidecar-1", "redis"):
        time.sleep(1.5)
        os.kill(dict(stack.procs)[name].pid, signal.SIGKILL)
    done = wait_done(c, b.id, timeout_s=180)
    assert done.status == "completed", done
    out, err = answers(c, done)
    ids = [x["custom_id"] for x in out + err]
    assert len(ids) == len(set(ids)) == n, (len(ids), len(set(ids)))
    assert set(ids) == {f"k-{i}" for i in range(n)}
    assert done.request_counts.completed + done.request_counts.failed == n
    assert len(out) >= n * 0.95, [e["error"] for e in err][:5]  # failures: retries exhausted


def create(c: openai.OpenAI, fid: str) -> Any:
    return c.batches.create(
        input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h"
    )


def test_files_list_expire_and_delete(stack: Stack) -> None:
    """OpenAI's file routes: list, `expires_after`, DELETE (not of an open batch's input)."""
    c = client(stack, "sk-demo-globex")
    f = c.files.create(
        file=("in.jsonl", jsonl(2, "x", max_tokens=400)),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert f.expires_at == f.created_at + 3600
    assert f.id in [x.id for x in c.files.list().data]
    b = create(c, f.id)
    with pytest.raises(openai.BadRequestError) as ei:
        c.files.delete(f.id)  # an open batch reads it
    assert ei.value.body["code"] == "file_in_use"  # type: ignore[index]
    c.batches.cancel(b.id)
    wait_done(c, b.id)
    assert c.files.delete(f.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)
    assert f.id not in [x.id for x in c.files.list().data]
    with pytest.raises(openai.NotFoundError):
        c.files.delete(f.id)


def test_storage_quotas_per_tenant_and_admission_unaffected(stack: Stack) -> None:
    """A tenant cannot fill the Redis every admission needs: files (12 here), bytes (1 MB)
    and uploads a minute (20) are bounded per tenant; its chat requests still go through."""
    c = client(stack, "sk-demo-acme").with_options(max_retries=0)
    big = jsonl(1800, "big")  # ~325 kB
    ids = [c.files.create(file=("b.jsonl", big), purpose="batch").id for _ in range(3)]
    with pytest.raises(openai.APIStatusError) as ei:
        c.files.create(file=("b.jsonl", big), purpose="batch")
    assert ei.value.status_code == 413
    assert ei.value.body["code"] == "storage_quota_exceeded"  # type: ignore[index]
    for fid in ids:
        c.files.delete(fid)
    small = [c.files.create(file=("s.jsonl", jsonl(1)), purpose="batch").id for _ in range(12)]
    with pytest.raises(openai.RateLimitError) as ei2:
        c.files.create(file=("s.jsonl", jsonl(1)), purpose="batch")
    assert ei2.value.body["code"] == "too_many_files"  # type: ignore[index]
    c.files.delete(small[0])
    with pytest.raises(openai.RateLimitError) as ei3:  # 15 uploads so far (refused: not counted)
        for _ in range(6):
            c.files.delete(c.files.create(file=("s.jsonl", jsonl(1)), purpose="batch").id)
    assert ei3.value.body["code"] == "uploads_per_min"  # type: ignore[index]
    answer = c.chat.completions.create(
        model="llama-3-8b", max_tokens=2, messages=[{"role": "user", "content": "still served"}]
    )
    assert answer.choices[0].message.content


def test_json_line_separators_ids_and_concurrent_creates(stack: Stack) -> None:
    """U+2028 is valid raw inside a JSON string (str.splitlines split on it); a name that is
    not an id answers 404, not a WRONGTYPE 500; concurrent creates cannot pass
    max_open_per_tenant (3 here)."""
    c = client(stack, "sk-demo-globex").with_options(max_retries=0)
    line = {
        "custom_id": "sep",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "llama-3-8b",
            "max_tokens": 400,
            "messages": [{"role": "user", "content": "a\u2028b\u0085c"}],
        },
    }
    raw = json.dumps(line, ensure_ascii=False).encode() + b"\n"
    assert "\u2028".encode() in raw
    f = c.files.create(file=("sep.jsonl", raw), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id + ":data")
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_x:res")
    from concurrent.futures import ThreadPoolExecutor

    def attempt(_i: int) -> str:
        try:
            return create(c, f.id).id
        except openai.RateLimitError:
            return ""

    with ThreadPoolExecutor(8) as pool:
        made = [b for b in pool.map(attempt, range(8)) if b]
    assert 1 <= len(made) <= 3, made
    for bid in made:
        c.batches.cancel(bid)
    for bid in made:
        assert wait_done(c, bid).request_counts.total == 1


def test_answers_leave_redis_with_their_output_file_and_storage_stays_bounded(
    stack: Stack,
) -> None:
    """Ten batches run and their files deleted: no answer key is left, every batch record and
    the tenant's list have a life, and the tenant's Redis memory is back under its bound."""
    import redis as redis_sync

    from admission.store import keys

    c = client(stack, "sk-demo-globex")
    r = redis_sync.Redis.from_url(stack.redis_url)
    try:
        for i in range(10):
            f = c.files.create(file=("in.jsonl", jsonl(20, f"b{i}")), purpose="batch")
            b = wait_done(c, create(c, f.id).id)
            assert b.status == "completed" and b.output_file_id
            assert not r.exists(keys.batch_results("globex", b.id))  # in the output file only
            assert r.ttl(keys.batch("globex", b.id)) > 0  # the record has a life
            for file_id in (f.id, b.output_file_id):
                c.files.delete(file_id)
        assert r.ttl(keys.tenant_batches("globex")) > 0
        used = sum(r.memory_usage(k) or 0 for k in r.scan_iter("*{bt:globex}*"))
        assert used < 64 * 1024, used  # ten batch records and a list: no answers, no files
    finally:
        r.close()


def test_a_batch_whose_output_would_pass_the_quota_is_refused_up_front(stack: Stack) -> None:
    """The output files count against the quota: a create that would exceed it is refused
    before any line runs (it was written past the quota at the end)."""
    c = client(stack, "sk-demo-hobbyist")
    kept = []
    try:
        while True:  # fill the 1 MB quota with inputs of ~390 KB
            try:
                kept.append(c.files.create(file=("in.jsonl", jsonl(1900)), purpose="batch").id)
            except openai.APIStatusError as exc:
                assert exc.status_code in (413, 429)
                break
        with pytest.raises(openai.APIStatusError) as info:
            create(c, kept[-1])
        assert info.value.status_code == 413 and info.value.code == "storage_quota_exceeded"
    finally:
        for fid in kept:
            c.files.delete(fid)
