"""Hardening through the real edge (nginx + ngx_lua, redis-server, a sidecar, emulated vLLM):
paths the edge does not serve, and answers that would outlive their lease."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from devstack.stack import Stack
from tests.conftest import started

pytestmark = pytest.mark.timeout(180)

LEASE_TTL_S = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from started(
        tmp_path_factory,
        "stack",
        nodes=2,
        sidecars=1,
        policy_overrides={
            "queue": {"lease_ttl_s": LEASE_TTL_S},
            "edge": {"sidecar_failure_mode": "open"},
        },
    )


def post(stack: Stack, path: str, body: Any, timeout: float = 30) -> tuple[int, bytes]:
    req = urllib.request.Request(
        stack.url + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer sk-demo-acme", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def sidecar_nodes(stack: Stack) -> list[dict[str, Any]]:
    """The sidecar's node views (`/nodes`)."""
    with urllib.request.urlopen(f"{stack.sidecar_url}/nodes", timeout=5) as r:
        return list(json.load(r)["nodes"])


def inflight(stack: Stack) -> int:
    return sum(int(n["inflight"]) for n in sidecar_nodes(stack))


@pytest.mark.parametrize(
    "path",
    [
        "/v1/embeddings",
        "/v1/responses",
        "/v1/audio/transcriptions",
        "/tokenize",
        "/score",
        "/v1/rerank",
        "/pooling",
        "/invocations",
    ],
)
def test_engine_paths_the_edge_does_not_admit_are_404_in_openai_shape(
    stack: Stack, path: str
) -> None:
    # Each would otherwise fall to the server's own `location /` (the default NGINX page here,
    # an engine behind a proxy_pass in front of existing infra): engine work with no key check,
    # no limit and no ledger.
    status, out = post(stack, path, {"model": "llama-3-8b", "input": "hello"})
    assert status == 404, out[:200]
    err = json.loads(out)["error"]
    assert err["code"] == "unknown_url" and path in err["message"]


def test_admitted_paths_still_served(stack: Stack) -> None:
    body = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert post(stack, "/v1/chat/completions", body)[0] == 200
    assert (
        post(stack, "/v1/completions", {"model": "llama-3-8b", "prompt": "hi", "max_tokens": 2})[0]
        == 200
    )


def test_a_stream_is_cut_off_when_its_lease_ends(stack: Stack) -> None:
    """A stream that runs past queue.lease_ttl_s would keep generating on a slot the ledger
    has given to someone else. The edge ends it at the lease's end, and the engine aborts it."""
    body = {
        "model": "llama-3-8b",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3000,  # ~36 s on the emulated A100
        "ignore_eos": True,
        "stream": True,
    }
    host, port = "127.0.0.1", stack.port
    started = time.monotonic()
    with socket.create_connection((host, port), timeout=30) as s:
        data = json.dumps(body).encode()
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-demo-acme"
            b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data
        )
        got = b""
        while chunk := s.recv(65536):
            got += chunk
            if time.monotonic() - started > 30:
                break
    took = time.monotonic() - started
    assert b"200 OK" in got.split(b"\r\n", 1)[0]
    assert b"data: [DONE]" not in got  # cut, not finished
    assert LEASE_TTL_S - 1.5 < took < LEASE_TTL_S + 3, took
    for _ in range(50):
        if inflight(stack) == 0:
            break
        time.sleep(0.1)
    assert inflight(stack) == 0


def test_a_plain_answer_waits_no_longer_than_its_lease(stack: Stack) -> None:
    body = {
        "model": "llama-3-8b",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3000,
        "ignore_eos": True,
    }
    started = time.monotonic()
    status, out = post(stack, "/v1/chat/completions", body)
    took = time.monotonic() - started
    assert status == 504, out[:200]
    assert json.loads(out)["error"]["code"] == "engine_timeout"
    assert took < LEASE_TTL_S + 3, took


def test_sidecar_sockets_are_for_nginx_workers_only(stack: Stack) -> None:
    """The local stack is as strict as production: sockets 0660 in a 0750 directory, group
    NGINX's workers'. Any other local user cannot reach a sidecar (that could name any tenant
    and drain nodes); before, 0666 in a 0755 directory let everyone in."""
    import errno
    import os
    import pwd
    import stat
    from pathlib import Path

    for sock in [*stack.sock_dir.glob("sidecar-*.sock"), *stack.sock_dir.glob("admit-*.sock")]:
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660, sock
    assert stat.S_IMODE(stack.sock_dir.stat().st_mode) == 0o750
    if os.geteuid() != 0:
        pytest.skip("needs root to try as another user")
    daemon = pwd.getpwnam("daemon")  # not in NGINX's group

    def reach(path: Path) -> int:
        """As that user, in a child process: 0 connected, else the errno."""
        pid = os.fork()
        if pid == 0:  # the child: never returns to pytest
            code = 0
            try:
                os.setgroups([])
                os.setgid(daemon.pw_gid)
                os.setuid(daemon.pw_uid)
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(path))
            except OSError as exc:
                code = exc.errno or 1
            os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    # The sidecar's, and NGINX's internal one (where the tenant is named by a header).
    for name in ("sidecar-0.sock", "admit-0.sock", "edge-internal.sock"):
        assert reach(stack.sock_dir / name) == errno.EACCES, name


def test_node_admin_on_the_unix_socket_needs_the_token(stack: Stack) -> None:
    """Where a token is configured, draining a node needs it on the unix socket too."""
    sock = str(stack.sock_dir / "sidecar-0.sock")

    def drain(headers: str) -> bytes:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(sock)
            s.sendall(
                b"POST /nodes/node-0/undrain HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                + headers.encode()
                + b"Connection: close\r\n\r\n"
            )
            return s.recv(65536)

    assert drain("").startswith(b"HTTP/1.1 401")
    assert drain(f"Authorization: Bearer {stack.admin_token}\r\n").startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    "path",
    [
        b"/nodes/node-0/x/../../../v1/files",
        b"/v1/files/%2e%2e/%2e%2e/nodes/node-0/drain",
        b"/v1/files/a%2Fb",
        b"/v1/batches/x/cancel/extra",
    ],
)
def test_only_the_batch_apis_own_paths_reach_the_sidecar(stack: Stack, path: bytes) -> None:
    with socket.create_connection(("127.0.0.1", stack.port), timeout=10) as s:
        s.sendall(
            b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-demo-acme"
            b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404"), got[:300]
    assert b"unknown_url" in body, got[:300]


def node_requests(stack: Stack) -> list[float]:
    out = []
    for port in stack.node_ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        out.append(
            sum(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("emulator_requests_by_priority_total{")
            )
        )
    return out


def node_states(stack: Stack) -> dict[str, str]:
    return {n["node"]: n["state"] for n in sidecar_nodes(stack)}


def fault(stack: Stack, node: int, **body: Any) -> None:
    req = urllib.request.Request(
        f"http://127.0.0.1:{stack.node_ports[node]}/sim/fault",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=5).close()


def wait_state(stack: Stack, node: str, want: str, within_s: float = 15) -> None:
    deadline = time.monotonic() + within_s
    while node_states(stack).get(node) != want:
        assert time.monotonic() < deadline, (node, want, node_states(stack))
        time.sleep(0.2)


def test_a_hung_redis_keeps_a_down_node_closed_and_the_edge_serving(stack: Stack) -> None:
    """redis-server frozen (SIGSTOP) past stale_after_s while node-1 fails its health checks
    (its agent said down): the sidecar fails open (redis.failure_mode: open) onto node-0 only —
    node-1, last seen down, stays closed — and every request is answered by node-0. Redis and
    the node back: the agent's states apply again. (Fail-open used to reopen every node: the
    six requests went to node-1, whose engine the fault also stops, and all six timed out, 504.)"""
    redis = dict(stack.procs)["redis"]
    fault(stack, 1, hang=True)  # /health never answers
    try:
        wait_state(stack, "node-1", "down")
        os.kill(redis.pid, signal.SIGSTOP)
        try:
            time.sleep(4.0)  # > stale_after_s (3 s): an outage, not a blip
            before = node_requests(stack)
            body = {
                "model": "llama-3-8b",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            }
            codes = [post(stack, "/v1/chat/completions", body)[0] for _ in range(6)]
            after = node_requests(stack)
            states = node_states(stack)
        finally:
            os.kill(redis.pid, signal.SIGCONT)
        assert codes == [200] * 6
        assert states == {"node-0": "open", "node-1": "down"}, states
        assert after[0] - before[0] == 6 and after[1] == before[1], (before, after)
    finally:
        fault(stack, 1, hang=False)
    wait_state(stack, "node-1", "open", 30)


def test_zz_fail_open_skips_a_drained_node(stack: Stack) -> None:
    """Runs last (it stops the sidecar). With no sidecar, `sidecar_failure_mode: open` proxies
    unadmitted — but only to nodes that took new work when a sidecar last saw them: not to one
    an operator drained (round-robin over every node of the table sent it half the traffic)."""
    req = urllib.request.Request(
        f"{stack.sidecar_url}/nodes/node-1/drain",
        method="POST",
        data=b"",
        headers={"Authorization": f"Bearer {stack.admin_token}"},
    )
    urllib.request.urlopen(req, timeout=5).close()
    table = json.loads((stack.sock_dir / "edge.json").read_text())
    assert table["nodes"]["node-1"]["serving"] is False
    assert table["nodes"]["node-0"]["serving"] is True
    time.sleep(1.5)  # the edge re-reads its table once a second
    for name, proc in stack.procs:
        if name.startswith("sidecar-"):
            proc.terminate()
            proc.wait(10)
    before = node_requests(stack)
    body = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert [post(stack, "/v1/chat/completions", body)[0] for _ in range(6)] == [200] * 6
    after = node_requests(stack)
    assert after[0] - before[0] == 6 and after[1] == before[1]
