"""The gateway layout (overlays/inference-pool): an InferencePool over both pools, llm-d's EPP configured for P/D,
a Gateway and HTTPRoute to the pool. Its objects pass closed schemas of the fields used (Inference Extension v1,
Gateway API v1, llm-d's EndpointPickerConfig; test_epp_config.py checks the config against what the pinned EPP
accepts), and they agree with each other and with the router: the EPP serves
the pool it names, its prefill and decode filters find the pods by role, the pool's target port is vLLM on a
prefill pod and the sidecar on a decode pod, and the `x-prefiller-host-port` the EPP writes names a member of the
sidecar's discovered prefill pool (router/gateway.py accepts it; anything else it refuses)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.cli import load_serve_settings
from router.discovery.base import worker_url
from router.discovery.settings import KubernetesConfig, parse_discovery
from router.domain import Role, WorkerSpec
from router.errors import BadRequest
from router.gateway import PREFILLER_HEADER, PrefillHeader, read_gateway_headers
from tests.unit.deploy import llm_d_router as llm_d
from tests.unit.deploy.kustomize import (
    INFERENCE_POOL,
    LAYOUTS,
    Doc,
    container,
    one,
    pod_templates,
    ports_of,
    render,
    selects,
)

_NAME = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
_META = {"type": "object", "required": ["name", "labels"]}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}


def _crd(api_version: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": api_version}, "metadata": _META, "spec": spec},
    }


def _closed(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": required, "properties": properties}


INFERENCEPOOL_SCHEMA = _crd(  # inference.networking.k8s.io/v1 (api/v1/inferencepool_types.go), the fields used
    "inference.networking.k8s.io/v1",
    _closed(
        ["selector", "targetPorts", "endpointPickerRef"],
        {
            "selector": _closed(
                ["matchLabels"], {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}
            ),
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "items": _closed(["number"], {"number": _PORT}),
            },
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": _closed(
                ["name", "port"],
                {
                    "group": {"type": "string"},
                    "kind": {"const": "Service"},
                    "name": _NAME,
                    "port": _closed(["number"], {"number": _PORT}),
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
            ),
        },
    ),
)
_BACKEND_REF = _closed(
    ["name"],
    {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME, "port": _PORT},
)
HTTPROUTE_SCHEMA = _crd(
    "gateway.networking.k8s.io/v1",
    _closed(
        ["parentRefs", "rules"],
        {
            "parentRefs": {
                "type": "array",
                "minItems": 1,
                "items": _closed(["name"], {"name": _NAME, "sectionName": _NAME}),
            },
            "rules": {
                "type": "array",
                "minItems": 1,
                "items": _closed(
                    ["backendRefs"],
                    {
                        "matches": {
                            "type": "array",
                            "items": _closed(
                                [],
                                {
                                    "path": _closed(
                                        ["type", "value"],
                                        {"type": {"enum": ["Exact", "PathPrefix"]}, "value": {"pattern": "^/"}},
                                    )
                                },
                            ),
                        },
                        "backendRefs": {"type": "array", "minItems": 1, "items": _BACKEND_REF},
                        "timeouts": _closed([], {"request": {"type": "string"}, "backendRequest": {"type": "string"}}),
                    },
                ),
            },
        },
    ),
)
EPP_CONFIG_SCHEMA = _closed(  # its shape; what each plugin accepts: test_epp_config.py
    ["apiVersion", "kind", "plugins", "schedulingProfiles"],
    {
        "apiVersion": {"const": llm_d.API_VERSION},
        "kind": {"const": llm_d.KIND},
        "plugins": {
            "type": "array",
            "items": _closed(
                ["type"], {"type": {"enum": sorted(llm_d.PLUGINS)}, "name": _NAME, "parameters": {"type": "object"}}
            ),
        },
        "schedulingProfiles": {
            "type": "array",
            "items": _closed(
                ["name", "plugins"],
                {
                    "name": _NAME,
                    "plugins": {
                        "type": "array",
                        "items": _closed(
                            ["pluginRef"], {"pluginRef": _NAME, "weight": {"type": "number", "minimum": 0}}
                        ),
                    },
                },
            ),
        },
    },
)
ROLE_LABEL = "llm-d.ai/role"


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return render(LAYOUTS["inference-pool"])


def epp_config(docs: list[Doc]) -> Doc:
    epp = one(docs, "Deployment", "kvpush-epp")["spec"]["template"]["spec"]
    (c,) = epp["containers"]
    path = Path(next(a for a in c["args"] if a.startswith("--config-file=")).split("=", 1)[1])
    (mount,) = c["volumeMounts"]
    assert path.parent == Path(mount["mountPath"])
    (volume,) = [v for v in epp["volumes"] if v["name"] == mount["name"]]
    config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
    return dict(yaml.safe_load(config_map["data"][path.name]))


def arg(c: Doc, flag: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in c["args"] if a.startswith(f"{flag}=")]
    return str(value)


def test_the_crd_objects_pass_closed_schemas_and_a_misspelt_key_fails(docs: list[Doc]) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema (comes with kubernetes-validate)")
    pool = one(docs, "InferencePool", "kvpush")
    jsonschema.validate(pool, INFERENCEPOOL_SCHEMA)
    jsonschema.validate(one(docs, "HTTPRoute", "kvpush-inference"), HTTPROUTE_SCHEMA)
    jsonschema.validate(epp_config(docs), EPP_CONFIG_SCHEMA)
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPortNumber"] = 8000  # the v1alpha2 spelling
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, INFERENCEPOOL_SCHEMA)
    config = epp_config(docs)
    config["plugins"].append({"type": "prefill-headers-handler"})  # misspelt
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, EPP_CONFIG_SCHEMA)


def test_the_epp_reads_the_config_that_is_checked_against_its_release(docs: list[Doc]) -> None:
    """test_epp_config.py checks components/inference-pool/epp-config.yaml (P/D with a declared decider, the
    prefill named in x-prefiller-host-port); the EPP mounts exactly that file."""
    assert epp_config(docs) == yaml.safe_load((INFERENCE_POOL / "epp-config.yaml").read_text())


def test_the_epp_serves_the_pool_that_names_it(docs: list[Doc]) -> None:
    pool = one(docs, "InferencePool", "kvpush")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"
    service = one(docs, "Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp = one(docs, "Deployment", "kvpush-epp")["spec"]["template"]
    assert selects(service["spec"]["selector"], epp["metadata"]["labels"])
    (c,) = epp["spec"]["containers"]
    assert c["image"] == f"{llm_d.IMAGE}:{llm_d.RELEASE}"  # the release the config is checked against
    assert ports_of(c)[port["targetPort"]] == int(arg(c, "--grpc-port"))
    assert arg(c, "--pool-name") == pool["metadata"]["name"]
    assert arg(c, "--pool-group") == pool["apiVersion"].split("/")[0] == llm_d.POOL_GROUP
    health = int(arg(c, "--grpc-health-port"))
    assert c["readinessProbe"]["grpc"]["port"] == health == c["livenessProbe"]["grpc"]["port"]
    rules = one(docs, "Role", "kvpush-epp")["rules"]
    readable = {
        (g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] if "watch" in rule["verbs"]
    }
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= readable
    assert {("llm-d.ai", "inferenceobjectives"), ("llm-d.ai", "inferencemodelrewrites")} <= readable
    binding = one(docs, "RoleBinding", "kvpush-epp")
    assert binding["subjects"][0]["name"] == epp["spec"]["serviceAccountName"]


def test_the_pool_holds_both_pools_and_the_filters_find_them_by_role(docs: list[Doc]) -> None:
    spec = one(docs, "InferencePool", "kvpush")["spec"]
    (target,) = spec["targetPorts"]
    selected = {
        t["metadata"]["labels"]["app.kubernetes.io/component"]: t
        for t in pod_templates(docs)
        if selects(spec["selector"]["matchLabels"], t["metadata"]["labels"])
    }
    assert set(selected) == {"prefill", "decode"}  # the EPP Deployment carries another component
    assert selected["prefill"]["metadata"]["labels"][ROLE_LABEL] == "prefill"
    assert selected["decode"]["metadata"]["labels"][ROLE_LABEL] == "decode"
    prefill_vllm = container(selected["prefill"]["spec"], "vllm")
    decode_router = container(selected["decode"]["spec"], "router")
    assert ports_of(prefill_vllm)["vllm"] == target["number"]  # the prefill named in the header is vLLM itself
    assert ports_of(decode_router)["http"] == target["number"]  # the decode destination is the sidecar
    assert target["number"] not in ports_of(container(selected["decode"]["spec"], "vllm")).values()


def test_the_route_sends_clients_to_the_pool(docs: list[Doc]) -> None:
    route = one(docs, "HTTPRoute", "kvpush-inference")["spec"]
    gateway = one(docs, "Gateway", "kvpush-inference")["spec"]
    (parent,) = route["parentRefs"]
    assert parent["sectionName"] in {listener["name"] for listener in gateway["listeners"]}
    (rule,) = route["rules"]
    (backend,) = rule["backendRefs"]
    pool = one(docs, backend["kind"], backend["name"])
    assert backend["group"] == pool["apiVersion"].split("/")[0]


def test_the_header_the_epp_writes_names_a_member_of_the_sidecar_s_prefill_pool(
    docs: list[Doc], tmp_path: Path
) -> None:
    """The EPP names the prefill pod as `<pod IP>:<target port>`; the sidecar discovers the prefill pool by
    pod IP and port: the two agree, so the sidecar accepts it, and refuses a pod of another port or pool."""
    decode = one(docs, "Deployment", "kvpush-decode")["spec"]["template"]["spec"]
    (volume,) = [v for v in decode["volumes"] if v["name"] == "router-config"]
    path = tmp_path / "router.yaml"
    path.write_text(one(docs, "ConfigMap", volume["configMap"]["name"])["data"]["router.yaml"])
    args = container(decode, "router")["args"]
    settings = load_serve_settings([str(path) if a == "/etc/kvpush/router.yaml" else a for a in args[1:]], {})
    assert settings.gateway.prefill_header is PrefillHeader.REQUIRED  # the sidecar reads the EPP's header
    discovered = {str(c.role): c for c in parse_discovery(settings.discovery)}["prefill"]
    assert isinstance(discovered, KubernetesConfig)
    (target,) = one(docs, "InferencePool", "kvpush")["spec"]["targetPorts"]
    pod_ip = "10.42.0.17"
    members = [WorkerSpec(worker_url(pod_ip, discovered.port), Role.PREFILL)]
    named = [(PREFILLER_HEADER.encode(), f"{pod_ip}:{target['number']}".encode())]
    assert read_gateway_headers(named, members).prefill == members[0]
    for other in (f"{pod_ip}:8200", f"10.42.0.18:{target['number']}"):
        with pytest.raises(BadRequest):
            read_gateway_headers([(PREFILLER_HEADER.encode(), other.encode())], members)
