"""The edge's pod: NGINX, the sidecars and a batch worker sharing the socket directory, the
snippets rendered from the policy by an init container; its Service and PodDisruptionBudget."""

from __future__ import annotations

from typing import Any

from admission.kubernetes.objects import (
    ADMIN_PORT,
    ADMIN_TOKEN,
    EDGE_PORT,
    SECRETS,
    SIDECARS,
    SNIPPETS_DIR,
    SOCKET_DIR,
    Cluster,
    admission,
    meta,
)

# NGINX as the image's unprivileged user: pid and temp files in an emptyDir, the modules that
# Debian's libnginx-mod-http-lua enables, the snippets rendered by the init container.
NGINX_CONF = f"""daemon off;
pid /tmp/nginx/nginx.pid;
error_log stderr warn;
worker_processes auto;
include /etc/nginx/modules-enabled/*.conf;
events {{ worker_connections 4096; }}
http {{
    access_log off;            # a log format of your own must never carry $http_authorization
    client_body_temp_path /tmp/nginx/body;
    proxy_temp_path /tmp/nginx/proxy;
    fastcgi_temp_path /tmp/nginx/fastcgi;
    uwsgi_temp_path /tmp/nginx/uwsgi;
    scgi_temp_path /tmp/nginx/scgi;
    default_type application/json;
    include {SNIPPETS_DIR}/admission_http.conf;
    include {SNIPPETS_DIR}/admission_internal.conf;
    server {{
        listen {EDGE_PORT} backlog=4096;
        include {SNIPPETS_DIR}/admission_locations.conf;
        location / {{
            content_by_lua_block {{ require("admission.edge.respond").not_served() }}
        }}
    }}
}}
"""


def edge(c: Cluster) -> list[dict[str, Any]]:
    sel = {"app.kubernetes.io/name": "admission-edge"}
    run = {"name": "sockets", "mountPath": SOCKET_DIR}
    snippets = {"name": "snippets", "mountPath": SNIPPETS_DIR}
    secrets = {"name": "secrets", "mountPath": "/etc/admission/secrets", "readOnly": True}
    sidecars = []
    for i in range(SIDECARS):
        args = ["serve", "--unix", f"{SOCKET_DIR}/sidecar-{i}.sock"]
        args += ["--admit-unix", f"{SOCKET_DIR}/admit-{i}.sock"]
        args += ["--edge-table", f"{SOCKET_DIR}/edge.json", "--host", "0.0.0.0"]
        args += ["--port", str(ADMIN_PORT + i), "--admin-token-file", ADMIN_TOKEN]
        port = {"name": f"metrics-{i}", "containerPort": ADMIN_PORT + i}
        sidecars.append(admission(f"sidecar-{i}", args, c, mounts=[run, secrets], ports=[port]))
    probe = {"httpGet": {"path": "/healthz", "port": EDGE_PORT}, "periodSeconds": 5}
    live = {"httpGet": {"path": "/livez", "port": EDGE_PORT}, "periodSeconds": 10}
    nginx = {
        "name": "nginx",
        "image": c.image,
        "command": ["nginx", "-c", "/etc/admission/policy/nginx.conf"],
        "ports": [{"name": "http", "containerPort": EDGE_PORT}],
        "readinessProbe": probe,
        "livenessProbe": live,
        "volumeMounts": [
            run,
            snippets,
            {"name": "policy", "mountPath": "/etc/admission/policy", "readOnly": True},
            {"name": "nginx-tmp", "mountPath": "/tmp/nginx"},
        ],
    }
    render_snippets = admission(
        "snippets",
        [
            "nginx-snippets",
            "--out",
            SNIPPETS_DIR,
            "--socket-dir",
            SOCKET_DIR,
            "--sidecars",
            str(SIDECARS),
        ],
        c,
        mounts=[snippets],
    )
    worker = admission(
        "batch-worker", ["batch-worker", "--edge-socket", f"{SOCKET_DIR}/edge-internal.sock"], c
    )
    worker["volumeMounts"].append(run)
    pod = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001},
        "initContainers": [render_snippets],
        "containers": [nginx, *sidecars, worker],
        "volumes": [
            {"name": "policy", "configMap": {"name": "admission-policy"}},
            {"name": "secrets", "secret": {"secretName": SECRETS}},
            {"name": "sockets", "emptyDir": {}},
            {"name": "snippets", "emptyDir": {}},
            {"name": "nginx-tmp", "emptyDir": {}},
        ],
    }
    metrics_ports = [
        {"name": f"metrics-{i}", "port": ADMIN_PORT + i, "targetPort": ADMIN_PORT + i}
        for i in range(SIDECARS)
    ]
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta("admission-edge", **sel),
            "spec": {
                "replicas": c.edge_replicas,
                "selector": {"matchLabels": sel},
                "template": {"metadata": {"labels": sel}, "spec": pod},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta("admission-edge", **sel),
            "spec": {
                "selector": sel,
                "ports": [{"name": "http", "port": 80, "targetPort": EDGE_PORT}, *metrics_ports],
            },
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta("admission-edge"),
            "spec": {"minAvailable": 1, "selector": {"matchLabels": sel}},
        },
    ]
