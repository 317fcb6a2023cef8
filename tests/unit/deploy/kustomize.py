"""The rendered Kubernetes layouts the deploy tests read: `kubectl kustomize` output as plain dicts, and small
lookups over it (one object, a container, its env and ports, which pods a selector picks)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "deploy" / "k8s"
LAYOUTS = {
    "base": K8S / "base",
    "standalone": K8S / "overlays" / "standalone",
    "kvpush-connector": K8S / "overlays" / "kvpush-connector",
    "session-affinity": K8S / "overlays" / "session-affinity",
    "inference-pool": K8S / "overlays" / "inference-pool",
    "tracing": K8S / "overlays" / "tracing",
}
SIDECAR = {"base", "kvpush-connector", "session-affinity", "inference-pool", "tracing"}  # router in the decode pods
AFFINITY = K8S / "components" / "session-affinity"  # the Gateway that hashes on the session header
INFERENCE_POOL = K8S / "components" / "inference-pool"  # the InferencePool, llm-d's EPP, their Gateway
TRACING = K8S / "components" / "tracing"  # the OpenTelemetry Collector; routers and engines send spans to it
TRACING_BACKEND = K8S / "components" / "tracing-backend"  # Jaeger all-in-one, the collector's default backend
KUBE_VERSION = "1.32"
PROMETHEUS_KINDS = {"PodMonitor", "PrometheusRule"}  # Prometheus Operator CRDs
GATEWAY_KINDS = {"Gateway", "HTTPRoute", "BackendTrafficPolicy"}  # Gateway API and Envoy Gateway CRDs
INFERENCE_KINDS = {"InferencePool"}  # Gateway API Inference Extension CRDs
CRD_KINDS = PROMETHEUS_KINDS | GATEWAY_KINDS | INFERENCE_KINDS  # not in kubernetes-validate: closed schemas
Doc = dict[str, Any]


def render(path: Path) -> list[Doc]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it renders the kustomizations: `kubectl kustomize`)")
    done = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"kubectl kustomize {path} failed:\n{done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def container(pod_spec: Doc, name: str) -> Doc:
    (found,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return dict(found)


def env_of(c: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in c.get("env", [])}


def ports_of(c: Doc) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_templates(docs: list[Doc]) -> list[Doc]:
    return [d["spec"]["template"] for d in docs if d["kind"] == "Deployment"]
