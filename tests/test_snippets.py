"""Adding the edge to an NGINX of one's own, as docs/operations.md's "Adding the edge to your NGINX" says:
`admission nginx-snippets` renders the files, a stock Debian-style nginx.conf (`user
www-data;`, its own http settings and access log) includes them, `admission serve` and
`admission agent` run as the systemd units would (sockets of group www-data in a 0750
directory), and the openai SDK is served through it."""

from __future__ import annotations

import grp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from devstack.nodes import NodeSet
from devstack.procs import RedisServer, free_port, port_open, stop_process, wait_for
from devstack.stack import DEFAULT_POLICY

pytestmark = pytest.mark.timeout(180)

STOCK = """user www-data;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
include {out}/admission_modules.conf;

events {{
    worker_connections 768;
}}

http {{
    sendfile on;
    tcp_nopush on;
    types_hash_max_size 2048;
    default_type application/octet-stream;
    access_log {d}/access.log;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;

    include {out}/admission_http.conf;
    include {out}/admission_internal.conf;

    server {{
        listen 127.0.0.1:{port};
        include {out}/admission_locations.conf;
    }}
}}
"""


WORK: list[Path] = []  # the fixture's directory (the stock config's access log is there)


@pytest.fixture(scope="module")
def edge(redis_server: RedisServer) -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("runs NGINX as `user www-data;`, which needs root")
    work = Path(tempfile.mkdtemp(prefix="snippets-"))
    WORK[:] = [work]
    work.chmod(0o755)  # NGINX's workers (www-data) read the rendered files and Lua modules
    run = work / "run"  # the units' /run/admission: sidecar group, 0750
    run.mkdir()
    os.chown(run, -1, grp.getgrnam("www-data").gr_gid)
    run.chmod(0o750)
    procs: list[subprocess.Popen[bytes]] = []
    nodes = NodeSet(1, work)
    try:
        raw = yaml.safe_load(DEFAULT_POLICY.read_text())
        raw["redis"]["url"] = redis_server.url
        raw["nodes"] = nodes.policy_nodes(max_inflight=8)
        policy = work / "policies.yaml"
        policy.write_text(yaml.safe_dump(raw, sort_keys=False))
        admission = [sys.executable, "-m", "admission.cli"]
        out = work / "nginx-admission"
        rendered = subprocess.run(
            [
                *admission,
                "nginx-snippets",
                "--out",
                str(out),
                "--policy",
                str(policy),
                "--sidecars",
                "1",
                "--socket-dir",
                str(run),
                "--group",
                "www-data",
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=work,
        )
        assert "user www-data" in rendered.stdout
        for path in (out / "admission_http.conf", out / "admission_locations.conf"):
            assert not re.search(r"@@[A-Z_]+@@", path.read_text()), path
        for d in ("body", "proxy"):
            (work / d).mkdir()
        procs.append(
            subprocess.Popen(
                [
                    *admission,
                    "serve",
                    "--policy",
                    str(policy),
                    "--unix",
                    str(run / "sidecar-0.sock"),
                    "--admit-unix",
                    str(run / "admit-0.sock"),
                    "--socket-group",
                    "www-data",
                    "--edge-table",
                    str(run / "edge.json"),
                ],
                cwd=work,
            )
        )
        procs.append(subprocess.Popen([*admission, "agent", "--policy", str(policy)], cwd=work))
        wait_for((run / "admit-0.sock").exists, 30, "sidecar", procs[0])
        port = free_port()
        conf = work / "nginx.conf"
        conf.write_text(STOCK.format(d=work, out=out, port=port))
        test = subprocess.run(
            ["nginx", "-t", "-c", str(conf), "-p", str(work)], capture_output=True, text=True
        )
        assert test.returncode == 0, test.stderr
        procs.append(
            subprocess.Popen(["nginx", "-g", "daemon off;", "-c", str(conf), "-p", str(work)])
        )
        wait_for(lambda: port_open(port), 10, "nginx", procs[-1])
        yield f"http://127.0.0.1:{port}"
    finally:
        for p in reversed(procs):
            stop_process(p)
        nodes.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_an_sdk_request_through_an_nginx_of_ones_own(edge: str) -> None:
    c = openai.OpenAI(base_url=f"{edge}/v1", api_key="sk-demo-acme", max_retries=3)
    answer = c.chat.completions.with_raw_response.create(
        model="llama-3-8b", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.parse().choices[0].message.content
    assert answer.headers["x-ratelimit-limit-requests"]
    # The access log of one's own http {} counts the request once: the edge's relay server
    # logs nothing of its own (it doubled log-based counts and bills).
    time.sleep(0.3)
    logged = (WORK[0] / "access.log").read_text()
    assert logged.count("/v1/chat/completions") == 1, logged
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{edge}/v1", api_key="sk-nope", max_retries=0).models.list()
