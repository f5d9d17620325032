"""`admission up` supervises: a child that dies is restarted with backoff and the stack keeps
serving — it never tears itself down because one child died."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.procs import Restarter
from devstack.stack import DEFAULT_POLICY, Stack
from tests.conftest import started

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from started(tmp_path_factory, "sup", nodes=1, sidecars=2, profile="tiny")


def chat(stack: Stack) -> int:
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ).encode()
    req = urllib.request.Request(
        f"{stack.url}/v1/chat/completions",
        data=body,
        headers={"Authorization": "Bearer sk-demo-acme", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        e.close()
        return int(e.code)


def kill_and_supervise(stack: Stack, name: str) -> list[str]:
    pid = dict(stack.procs)[name].pid
    os.kill(pid, signal.SIGKILL)
    events: list[str] = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not events:
        time.sleep(0.2)
        events = stack.supervise()
    assert dict(stack.procs)[name].pid != pid
    return events


def test_dead_sidecar_is_restarted_and_the_edge_keeps_serving(stack: Stack) -> None:
    assert chat(stack) == 200
    events = kill_and_supervise(stack, "sidecar-0")
    assert events and events[0].startswith("sidecar-0 exited with -9; restarted")
    assert chat(stack) == 200  # the other sidecar answered meanwhile, or the new one does
    deadline = time.monotonic() + 20
    while not (stack.sock_dir / "sidecar-0.sock").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    answers = [chat(stack) for _ in range(6)]
    assert answers == [200] * 6, answers


def test_dead_redis_and_node_come_back(stack: Stack) -> None:
    events = kill_and_supervise(stack, "redis")
    assert events and "redis exited with -9; restarted" in events[0]
    deadline = time.monotonic() + 20
    ok = False
    while time.monotonic() < deadline and not ok:  # fail-open meanwhile, then Redis again
        ok = chat(stack) == 200
        time.sleep(0.3)
    assert ok
    assert stack.nodes is not None
    old = stack.nodes.procs[0].pid
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and stack.nodes.procs[0].pid == old:
        time.sleep(0.2)
        stack.supervise()
    assert stack.nodes.procs[0].pid != old
    deadline = time.monotonic() + 30
    ok = False
    while time.monotonic() < deadline and not ok:  # the agent sees it open again
        ok = chat(stack) == 200
        time.sleep(0.5)
    assert ok


def test_backoff_grows_for_a_child_that_keeps_dying() -> None:
    now = [0.0]
    r = Restarter(clock=lambda: now[0])
    r.started("x")
    waits = []
    for _ in range(5):
        now[0] += 1.0  # dies a second after each start
        first = now[0]
        while not r.due("x"):
            now[0] += 0.1
        waits.append(round(now[0] - first, 1))
        r.started("x")
    assert waits == pytest.approx([0.5, 1.0, 2.0, 4.0, 8.0], abs=0.15)
    now[0] += 120  # ran long enough: back to the shortest backoff
    first = now[0]
    while not r.due("x"):
        now[0] += 0.1
    assert now[0] - first == pytest.approx(0.5, abs=0.15)


def test_a_stack_killed_without_its_cleanup_takes_its_children_with_it(tmp_path: Path) -> None:
    """`admission up` (or a benchmark, or pytest) killed by SIGKILL runs no `stop`: its children,
    each in a session of its own, kept running — sidecars, Redis, NGINX, nodes — and the next
    run shared the cores with them. Each is tied to its parent now (procs.with_parent)."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from devstack.stack import DEFAULT_POLICY, Stack\n"
        "s = Stack(DEFAULT_POLICY, Path(sys.argv[1]), nodes=1, sidecars=2, profile='tiny')\n"
        "s.start()\n"
        "assert s.nodes is not None\n"
        "pids = [p.pid for _n, p in s.procs] + [p.pid for p in s.nodes.procs]\n"
        "print(' '.join(map(str, pids)), flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) >= 5, pids  # redis, two sidecars, the agent or NGINX, a node
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)]
    finally:
        for p in [proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p, signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _alive(pid: int) -> bool:
    """Running (a zombie — ended, not yet reaped by init — counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_ports_taken_while_the_nodes_start_are_picked_again(tmp_path: Path) -> None:
    # A real vLLM node binds loopback ports of its own while it starts (a minute): it once took
    # the admin port picked at construction, and the sidecar failed "address already in use".
    # Here both ports picked at construction are taken before start(): the stack still starts.
    s = Stack(DEFAULT_POLICY, tmp_path / "run", nodes=1, sidecars=1, profile="tiny")
    taken = []
    for port in (s.port, s.admin_port):
        sock = socket.socket()
        sock.bind(("127.0.0.1", port))
        sock.listen()
        taken.append(sock)
    try:
        s.start()
        assert s.port not in (t.getsockname()[1] for t in taken)
        assert chat(s) == 200
    finally:
        s.stop()
        for sock in taken:
            sock.close()
