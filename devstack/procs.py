"""Process helpers for the local stack, benchmarks and tests: free loopback ports, readiness
waits, redis-server, stopping a process group."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_GIVEN: set[int] = set()  # ports this process handed out already


def free_port() -> int:
    """A loopback port nothing listens on now, and that this process has not handed out before:
    the kernel may give a port just closed again, and a stack that asks for several (NGINX,
    nodes, sidecars) before starting any would otherwise get one twice (NGINX then failed with
    "Address already in use" on an engine node's port)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def wait_for(
    check: Callable[[], bool],
    timeout_s: float = 10.0,
    what: str = "condition",
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll `check` until true; TimeoutError after `timeout_s`, RuntimeError if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        try:
            if check():
                return
        except OSError:  # urllib's URLError and connection refusals are OSErrors
            pass
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


def with_parent() -> Callable[[], None]:
    """A `preexec_fn` that ties a child to this process: it gets SIGTERM when the thread that
    started it ends (Linux's PR_SET_PDEATHSIG; elsewhere nothing). The children run in sessions
    of their own (Ctrl-C reaches them only through `stop`), so a stack, benchmark or test run
    killed without its cleanup (SIGKILL, a CI timeout) left every sidecar, Redis and node
    running, and the next run shared the cores with them. Start children from the main thread,
    or from a thread that lives as long as they should."""
    parent, prctl = os.getpid(), _prctl()
    if prctl is None:
        return lambda: None

    def tie() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it ended before the tie was made
            os.kill(os.getpid(), signal.SIGTERM)

    return tie


PR_SET_PDEATHSIG = 1


@functools.cache
def _prctl() -> Any:
    """libc's prctl, opened once (None where there is none)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def sidecar_command(policy: str, unix: str, level: str = "warning") -> list[str]:
    """`admission serve` on a unix socket, as benchmarks and tests start it (this interpreter)."""
    serve = ["serve", "--policy", policy, "--unix", unix]
    return [sys.executable, "-m", "admission.cli", "--log-level", level, *serve]


@contextlib.contextmanager
def sidecars(policy: Path, socks: list[str], log_dir: Path) -> Iterator[list[Path]]:
    """Start one `admission serve` per unix socket (logs in `log_dir`, which must not be the
    policy's directory: its watcher would see them), wait until every socket is up, yield the
    log paths; stop them all on the way out. A sidecar that exits while starting fails with its
    log's tail."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    paths = [log_dir / f"sidecar-{k}.log" for k in range(len(socks))]
    try:
        for sock, path in zip(socks, paths, strict=True):
            with path.open("w") as log:  # the child keeps its own descriptor
                procs.append(
                    subprocess.Popen(
                        sidecar_command(str(policy), sock),
                        stderr=log,
                        start_new_session=True,
                        preexec_fn=with_parent(),
                    )
                )
        for sock, proc, path in zip(socks, procs, paths, strict=True):
            try:
                wait_for(functools.partial(os.path.exists, sock), 60, "sidecar", proc)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}: {path.read_text()[-2000:]}") from None
        yield paths
    finally:
        for proc in procs:
            stop_process(proc)


def pin_apart() -> str:
    """Keep engines off the CPU the rest of a benchmark uses: this process (and whatever it
    starts from now on: NGINX, Redis, sidecars, the load generator) moves to every CPU but the
    last; returns the last one's number for the engine nodes (NodeSet's `cpus`), or "" on a
    machine with one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return ""
    os.sched_setaffinity(0, set(cpus[:-1]))
    return str(cpus[-1])


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=1) as r:
        return bool(r.status == 200)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class RedisServer:
    """A redis-server on a free loopback port, in its own directory; restartable."""

    def __init__(self, workdir: Path, extra: list[str] | None = None) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server missing: run scripts/setup.sh")
        self.workdir = workdir
        self.extra = extra or []
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            *self.extra,
        ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=with_parent()
        )
        wait_for(lambda: port_open(self.port), what=f"redis on {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL what is left of a child's process group (NGINX workers outlive a killed master
    and keep its port)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM the process group (children included), SIGKILL it after `timeout_s`."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()


class Restarter:
    """Restarts children that died, with exponential backoff, and says so (`admission up`).

    A child that ran for `STABLE_S` before dying starts again at the shortest backoff; one that
    keeps dying waits 0.5, 1, 2 … up to `MAX_BACKOFF_S` seconds between attempts.
    """

    FIRST_S = 0.5
    MAX_BACKOFF_S = 30.0
    STABLE_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._due: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._started: dict[str, float] = {}
        self.restarts: dict[str, int] = {}

    def started(self, name: str) -> None:
        self._started[name] = self.clock()

    def due(self, name: str) -> bool:
        """Call when `name` is found dead; True when it is time to start it again."""
        now = self.clock()
        if name not in self._due:
            ran = now - self._started.get(name, now)
            b = self.FIRST_S if ran >= self.STABLE_S else self._backoff.get(name, self.FIRST_S / 2)
            self._backoff[name] = min(self.MAX_BACKOFF_S, b * 2 if ran < self.STABLE_S else b)
            self._due[name] = now + self._backoff[name]
        if now < self._due[name]:
            return False
        del self._due[name]
        self.restarts[name] = self.restarts.get(name, 0) + 1
        return True
