"""Session affinity at the front door: the Gateway component renders on both router layouts, its objects pass
closed schemas of the fields used (Gateway API v1, Envoy Gateway v1alpha1), it hashes on the very header the
router reads as the session id, reaches the routers through the kvpush Service, and lets the router's own
deadlines decide; every layout keeps the plain Service as the fallback."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.cli import load_serve_settings
from router.deciders.conversation import SESSION_HEADER
from tests.unit.deploy.kustomize import (
    AFFINITY,
    GATEWAY_KINDS,
    LAYOUTS,
    SIDECAR,
    Doc,
    one,
    pod_templates,
    render,
    selects,
)

_NAME = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
_META = {"type": "object", "required": ["name", "labels"]}
_GATEWAY_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}  # Gateway API's Duration
_LOCAL_REF = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {"name": _NAME, "sectionName": _NAME, "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
}


def _crd(api_version: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": api_version}, "metadata": _META, "spec": spec},
    }


GATEWAY_SCHEMA = _crd(
    "gateway.networking.k8s.io/v1",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["gatewayClassName", "listeners"],
        "properties": {
            "gatewayClassName": _NAME,
            "listeners": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "protocol", "port"],
                    "properties": {
                        "name": _NAME,
                        "protocol": {"enum": ["HTTP", "HTTPS"]},
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                    },
                },
            },
        },
    },
)
HTTPROUTE_SCHEMA = _crd(
    "gateway.networking.k8s.io/v1",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["parentRefs", "rules"],
        "properties": {
            "parentRefs": {"type": "array", "minItems": 1, "items": _LOCAL_REF},
            "rules": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["backendRefs"],
                    "properties": {
                        "matches": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "path": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "required": ["type", "value"],
                                        "properties": {
                                            "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                            "value": {"type": "string", "pattern": "^/"},
                                        },
                                    }
                                },
                            },
                        },
                        "backendRefs": {"type": "array", "minItems": 1, "items": _LOCAL_REF},
                        "timeouts": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"request": _GATEWAY_DURATION, "backendRequest": _GATEWAY_DURATION},
                        },
                    },
                },
            },
        },
    },
)
BACKENDTRAFFICPOLICY_SCHEMA = _crd(
    "gateway.envoyproxy.io/v1alpha1",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["targetRefs", "loadBalancer"],
        "properties": {
            "targetRefs": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["group", "kind", "name"],
                    "properties": {
                        "group": {"const": "gateway.networking.k8s.io"},
                        "kind": {"enum": ["Gateway", "HTTPRoute", "GRPCRoute"]},
                        "name": _NAME,
                    },
                },
            },
            "loadBalancer": {
                "type": "object",
                "additionalProperties": False,
                "required": ["type"],
                "properties": {
                    "type": {"enum": ["ConsistentHash", "LeastRequest", "Random", "RoundRobin"]},
                    "consistentHash": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type"],
                        "properties": {
                            "type": {"enum": ["SourceIP", "Header", "Cookie"]},
                            "header": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["name"],
                                "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9-]+$"}},
                            },
                        },
                    },
                },
            },
        },
    },
)
SCHEMAS = {
    "Gateway": GATEWAY_SCHEMA,
    "HTTPRoute": HTTPROUTE_SCHEMA,
    "BackendTrafficPolicy": BACKENDTRAFFICPOLICY_SCHEMA,
}


def with_affinity(layout: Path, where: Path) -> list[Doc]:
    """Any layout plus the session-affinity component, the way the README tells an overlay to add it."""
    where.mkdir()
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(layout, where)],
        "components": [os.path.relpath(AFFINITY, where)],
    }
    (where / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(where)


def gateway_docs(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in GATEWAY_KINDS]


def test_every_layout_keeps_the_plain_service_and_only_the_gateway_layouts_have_a_gateway() -> None:
    expected = {"session-affinity": sorted(GATEWAY_KINDS), "inference-pool": ["Gateway", "HTTPRoute"]}
    for name, path in LAYOUTS.items():
        docs = render(path)
        assert one(docs, "Service", "kvpush")["spec"]["type"] == "ClusterIP"  # the fallback: no affinity
        kinds = sorted(d["kind"] for d in gateway_docs(docs))
        assert kinds == expected.get(name, []), name


@pytest.mark.parametrize("layout", ["session-affinity", "standalone"])
def test_the_gateway_objects_pass_closed_schemas_and_a_misspelt_key_fails(layout: str, tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema (comes with kubernetes-validate)")
    docs = render(LAYOUTS[layout]) if layout == "session-affinity" else with_affinity(LAYOUTS[layout], tmp_path / "o")
    found = gateway_docs(docs)
    assert sorted(d["kind"] for d in found) == sorted(GATEWAY_KINDS)
    for doc in found:
        jsonschema.validate(doc, SCHEMAS[doc["kind"]])
    broken = copy.deepcopy(one(docs, "BackendTrafficPolicy", "kvpush-session-affinity"))
    broken["spec"]["loadBalancer"]["consistentHash"]["httpHeaderName"] = SESSION_HEADER  # Istio's spelling
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, BACKENDTRAFFICPOLICY_SCHEMA)


def test_the_front_hashes_on_the_header_the_router_reads_as_the_session() -> None:
    docs = render(LAYOUTS["session-affinity"])
    policy = one(docs, "BackendTrafficPolicy", "kvpush-session-affinity")["spec"]
    assert policy["loadBalancer"]["type"] == "ConsistentHash"
    assert policy["loadBalancer"]["consistentHash"]["type"] == "Header"
    assert policy["loadBalancer"]["consistentHash"]["header"]["name"].lower() == SESSION_HEADER
    (target,) = policy["targetRefs"]
    assert one(docs, target["kind"], target["name"])  # the policy applies to the route clients take


@pytest.mark.parametrize("layout", ["session-affinity", "standalone"])
def test_the_route_reaches_the_routers_through_the_kvpush_service(layout: str, tmp_path: Path) -> None:
    docs = render(LAYOUTS[layout]) if layout == "session-affinity" else with_affinity(LAYOUTS[layout], tmp_path / "o")
    route = one(docs, "HTTPRoute", "kvpush")["spec"]
    gateway = one(docs, "Gateway", "kvpush")["spec"]
    (parent,) = route["parentRefs"]
    assert parent["name"] == "kvpush"
    assert parent["sectionName"] in {listener["name"] for listener in gateway["listeners"]}
    (rule,) = route["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]  # every OpenAI path
    (backend,) = rule["backendRefs"]
    service = one(docs, "Service", backend["name"])["spec"]
    assert backend["port"] in {p["port"] for p in service["ports"]}
    pods = [t for t in pod_templates(docs) if selects(service["selector"], t["metadata"]["labels"])]
    containers = {c["name"] for t in pods for c in t["spec"]["containers"]}
    assert "router" in containers, f"{layout}: the route must end at router containers, not at vLLM alone"
    expected = "decode" if layout in SIDECAR else "router"
    assert {t["metadata"]["labels"]["app.kubernetes.io/component"] for t in pods} == {expected}


def test_the_route_outlasts_every_answer_the_router_lets_run(tmp_path: Path) -> None:
    docs = render(LAYOUTS["session-affinity"])
    (rule,) = one(docs, "HTTPRoute", "kvpush")["spec"]["rules"]
    config = one(docs, "ConfigMap", next(d["metadata"]["name"] for d in docs if is_router_config(d)))
    path = tmp_path / "router.yaml"
    path.write_text(config["data"]["router.yaml"])
    timeouts = load_serve_settings(["--config", str(path)], {}).timeouts
    assert seconds(rule["timeouts"]["request"]) > timeouts.prefill + timeouts.decode_total


def is_router_config(doc: Doc) -> bool:
    return doc["kind"] == "ConfigMap" and "router.yaml" in doc.get("data", {})


def seconds(duration: str) -> float:
    """A Gateway API duration ("1h30m", "1800s", "500ms") in seconds."""
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"([0-9]+)(ms|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, f"not a Gateway API duration: {duration!r}"
    return sum(int(n) * scale[u] for n, u in parts)
