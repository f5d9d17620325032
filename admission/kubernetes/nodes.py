"""A model's vLLM pods: vLLM and an agent that registers the pod and leaves on SIGTERM (vLLM's
preStop waits for its requests), and KEDA's ScaledObject sizing them by the demand signal."""

from __future__ import annotations

from typing import Any

from admission.kubernetes.objects import VLLM_IMAGE, VLLM_PORT, Cluster, admission, meta, slug

# vLLM's preStop: the agent drains the node on the same SIGTERM; keep vLLM serving until the
# requests it holds have ended (its own gauges), so that none is cut.
WAIT_IDLE = (
    "import time, urllib.request as u\n"
    "time.sleep(3)\n"
    "for _ in range(int({grace})):\n"
    "    m = u.urlopen('http://127.0.0.1:{port}/metrics').read().decode()\n"
    "    busy = sum(float(l.split()[-1]) for l in m.splitlines()\n"
    "               if l.startswith(('vllm:num_requests_running', 'vllm:num_requests_waiting')))\n"
    "    if busy == 0: break\n"
    "    time.sleep(1)\n"
)


def vllm(model: str, c: Cluster) -> list[dict[str, Any]]:
    name = f"vllm-{slug(model)}"
    sel = {"app.kubernetes.io/name": name}
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "ADMISSION_NODE_ID", "value": "$(POD_NAME)"},
        {"name": "ADMISSION_NODE_URL", "value": f"http://$(POD_IP):{VLLM_PORT}"},
        {"name": "ADMISSION_NODE_MODELS", "value": model},
        # The GPU belongs to the vLLM container (the device plugin shows it to that one only):
        # the agent reads vLLM's KV usage, not NVML (docs/operations.md says how to use NVML).
        {"name": "ADMISSION_NODE_MEMORY_SOURCE", "value": "kv"},
        {"name": "ADMISSION_DRAIN_GRACE_S", "value": str(c.grace_s)},
    ]
    agent = admission("agent", ["agent", "--register"], c)
    agent["env"] = env + agent["env"]
    wait = WAIT_IDLE.format(grace=c.grace_s, port=VLLM_PORT)
    vllm = {
        "name": "vllm",
        "image": VLLM_IMAGE,
        "args": ["--model", model, "--port", str(VLLM_PORT), "--scheduling-policy", "priority"],
        "ports": [{"name": "http", "containerPort": VLLM_PORT}],
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": VLLM_PORT}, "periodSeconds": 5},
        "lifecycle": {"preStop": {"exec": {"command": ["python3", "-c", wait]}}},
    }
    pod = {
        "terminationGracePeriodSeconds": c.grace_s + 30,
        "containers": [vllm, agent],
        "volumes": [{"name": "policy", "configMap": {"name": "admission-policy"}}],
    }
    needed = f'max(admission_model_nodes_needed{{model="{model}"}})'
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta(name, **sel),
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": sel},
                "template": {"metadata": {"labels": sel}, "spec": pod},
            },
        },
        {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": meta(name),
            "spec": {
                "scaleTargetRef": {"name": name},
                "minReplicaCount": 1,
                "maxReplicaCount": c.max_nodes,
                "pollingInterval": 15,
                # Scale in only after the signal stayed low a while (a leave drains, and costs).
                "advanced": {
                    "horizontalPodAutoscalerConfig": {
                        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}
                    }
                },
                # AverageValue 1: replicas = ceil(nodes needed), the max over the sidecars.
                "triggers": [
                    {
                        "type": "prometheus",
                        "metricType": "AverageValue",
                        "metadata": {
                            "serverAddress": c.prometheus_url,
                            "query": needed,
                            "threshold": "1",
                        },
                    }
                ],
            },
        },
    ]
