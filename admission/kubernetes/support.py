"""What the edge and the nodes lean on: a trial Redis (one StatefulSet), and the monitoring
objects of the Prometheus operator (the sidecars' ServiceMonitor, the shipped alerts)."""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

from admission.kubernetes.objects import REDIS_IMAGE, SIDECARS, Cluster, meta


def redis(c: Cluster) -> list[dict[str, Any]]:
    sel = {"app.kubernetes.io/name": "admission-redis"}
    redis = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "args": ["--appendonly", "yes", "--save", ""],
        "ports": [{"name": "redis", "containerPort": 6379}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    claim = {
        "metadata": {"name": "data"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": meta("admission-redis", **sel),
            "spec": {
                "serviceName": "admission-redis",
                "replicas": 1,
                "selector": {"matchLabels": sel},
                "template": {"metadata": {"labels": sel}, "spec": {"containers": [redis]}},
                "volumeClaimTemplates": [claim],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta("admission-redis", **sel),
            "spec": {"selector": sel, "ports": [{"name": "redis", "port": 6379}]},
        },
    ]


def monitoring(c: Cluster) -> list[dict[str, Any]]:
    alerts = yaml.safe_load(
        resources.files("admission").joinpath("monitoring", "alerts.yaml").read_text()
    )
    sel = {"app.kubernetes.io/name": "admission-edge"}
    return [
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": meta("admission-sidecars"),
            "spec": {
                "selector": {"matchLabels": sel},
                "endpoints": [
                    {"port": f"metrics-{i}", "path": "/metrics", "interval": "15s"}
                    for i in range(SIDECARS)
                ],
            },
        },
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PrometheusRule",
            "metadata": meta("admission-alerts"),
            "spec": {"groups": alerts["groups"]},
        },
    ]
