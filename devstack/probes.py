"""What a running stack still holds: used by the chaos suite and the fuzzer to check that
nothing stays booked once traffic stops (the keys themselves, not their TTLs)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import redis

from admission.store import keys


def booked(redis_url: str) -> dict[str, Any]:
    """Everything still booked in Redis: node leases, concurrency slots, reservations, ledger KV."""
    r = redis.Redis.from_url(redis_url, socket_timeout=2, decode_responses=True)
    out: dict[str, Any] = {}
    try:
        for k in r.scan_iter(f"{keys.PREFIX}:*", count=1000):
            if k.endswith((":leases", ":cc")):
                if n := r.zcard(k):
                    out[k] = n
            elif ":res:" in k:
                res: dict[str, str] = r.hgetall(k)  # type: ignore[assignment]  # decoded
                if "tok" in res:  # not a release's mark for a booking on its way (settle.lua)
                    out[k] = res
            elif k.endswith(":ledger"):
                h: dict[str, str] = r.hgetall(k)  # type: ignore[assignment]  # decoded
                # k: a lease's own KV; h:/b: prefix blocks held (reference counts, a lease's list)
                held = {f: v for f, v in h.items() if f.startswith(("k:", "h:", "b:"))}
                if held or float(h.get("kv", 0)) > 0:
                    out[k] = {"kv": h.get("kv"), **held}
    finally:
        r.close()
    return out


def wait_unbooked(redis_url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Poll `booked` until it is empty (releases are delivered asynchronously); what is left."""
    deadline = time.monotonic() + timeout_s
    left = booked(redis_url)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = booked(redis_url)
    return left


def unix_get(sock: Path, path: str) -> tuple[int, Any]:
    """GET over a sidecar's unix socket: (status, the JSON body)."""
    with socket.socket(socket.AF_UNIX) as c:
        c.settimeout(5)
        c.connect(str(sock))
        c.sendall(f"GET {path} HTTP/1.0\r\nHost: s\r\n\r\n".encode())
        data = b""
        while chunk := c.recv(65536):
            data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def metric_sums(sock_dir: Path, *series: str) -> list[float]:
    """Each series' value summed over every sidecar's /metrics (on their unix sockets): a line
    counts for a series when it starts with it (give the labels, or a trailing space)."""
    sums = [0.0] * len(series)
    for sock in sorted(sock_dir.glob("sidecar-*.sock")):
        with socket.socket(socket.AF_UNIX) as c:
            c.settimeout(5)
            c.connect(str(sock))
            c.sendall(b"GET /metrics HTTP/1.0\r\nHost: s\r\n\r\n")
            data = b""
            while chunk := c.recv(65536):
                data += chunk
        for line in data.decode().splitlines():
            for i, name in enumerate(series):
                if line.startswith(name):
                    sums[i] += float(line.split()[-1])
    return sums


def refunded(sock_dir: Path, tenant: str) -> float:
    """Tokens refunded to `tenant` so far, over every sidecar."""
    series = f'admission_settled_tokens_total{{direction="refund",tenant="{tenant}"}}'
    return metric_sums(sock_dir, series)[0]


def sidecar_health(sock_dir: Path) -> list[tuple[int, str]]:
    """Every sidecar's /healthz (status code, status) over its unix socket."""
    out = []
    for sock in sorted(sock_dir.glob("sidecar-*.sock")):
        code, body = unix_get(sock, "/healthz")
        out.append((code, body["status"]))
    return out


def log_findings(run_dir: Path, secrets: set[str]) -> list[str]:
    """Tracebacks in the Python processes' logs, Lua errors in NGINX's, and any of `secrets`
    (API keys) anywhere."""
    found = []
    for log in sorted(run_dir.glob("*.log")):
        text = log.read_text(errors="replace")
        if log.name.startswith(("sidecar-", "agent")) and "Traceback" in text:
            found.append(f"{log.name}: traceback")
        if log.name.startswith("nginx") and ("runtime error" in text or "thread aborted" in text):
            found.append(f"{log.name}: Lua error")
        if log.name.startswith("nginx") and "using uninitialized" in text:
            found.append(f"{log.name}: a variable read before it is set (a warning per request)")
        if any(len(k) >= 8 and k in text for k in secrets):
            found.append(f"{log.name}: an API key appears in the log")
    return found
