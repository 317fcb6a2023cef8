"""The Kubernetes manifests: they render with kustomize, pass the Kubernetes 1.32 schemas offline (strict), and
agree with each other and with the router (ports, probes, NIXL settings, the router's own config loader)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.cli import load_serve_settings
from tests.unit.deploy.kustomize import (
    CRD_KINDS,
    KUBE_VERSION,
    LAYOUTS,
    REPO,
    SIDECAR,
    Doc,
    container,
    env_of,
    one,
    pod_templates,
    ports_of,
    render,
    selects,
)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, render(LAYOUTS[request.param])


# --- schemas ---------------------------------------------------------------------------------------------------


def test_every_builtin_object_passes_the_kubernetes_schema_strictly(layout: tuple[str, list[Doc]]) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (the dev extra)")
    name, docs = layout
    if kv.utils.major_minor(KUBE_VERSION) > kv.utils.latest_version():
        pytest.fail(f"kubernetes-validate {kv.utils.latest_version()} has no {KUBE_VERSION} schemas: needs >= 1.32")
    checked = 0
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue  # no schema in kubernetes-validate: checked structurally below
        try:
            kv.validate(doc, KUBE_VERSION, strict=True)
        except kv.ValidationError as error:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {error.message} at {list(error.path)}")
        checked += 1
    assert checked >= 10


def test_the_schema_check_rejects_a_broken_deployment(layout: tuple[str, list[Doc]]) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (the dev extra)")
    deployment = copy.deepcopy(one(layout[1], "Deployment", "kvpush-prefill"))
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, KUBE_VERSION, strict=True)
    deployment = copy.deepcopy(one(layout[1], "Deployment", "kvpush-prefill"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}  # misspelt: strict refuses it
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, KUBE_VERSION, strict=True)


# The fields of monitoring.coreos.com/v1 objects these manifests use (Prometheus Operator CRDs), closed so a
# misspelt key fails. kubernetes-validate has no CRD schemas; this is the structural check in their place.
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
        "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep", "hashmod"]},
    },
}
_DURATION = {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$"}
_META = {"type": "object", "required": ["name", "labels"]}
PODMONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port", "path"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "relabelings": {"type": "array", "items": _RELABEL},
                            "metricRelabelings": {"type": "array", "items": _RELABEL},
                        },
                    },
                },
            },
        },
    },
}
PROMETHEUSRULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string"},
                            "interval": _DURATION,
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["alert", "expr"],
                                    "properties": {
                                        "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9]*$"},
                                        "expr": {"type": "string", "minLength": 1},
                                        "for": _DURATION,
                                        "labels": {
                                            "type": "object",
                                            "required": ["severity"],
                                            "additionalProperties": {"type": "string"},
                                        },
                                        "annotations": {
                                            "type": "object",
                                            "required": ["summary", "description"],
                                            "additionalProperties": {"type": "string"},
                                        },
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}


def test_prometheus_operator_objects_are_well_formed(layout: tuple[str, list[Doc]]) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema (comes with kubernetes-validate)")
    docs = layout[1]
    schemas = {"PodMonitor": PODMONITOR_SCHEMA, "PrometheusRule": PROMETHEUSRULE_SCHEMA}
    kinds = [d["kind"] for d in docs if d["kind"] in schemas]
    assert sorted(kinds) == ["PodMonitor", "PodMonitor", "PrometheusRule"]
    for doc in docs:
        if doc["kind"] in schemas:
            jsonschema.validate(doc, schemas[doc["kind"]])
    broken = copy.deepcopy(one(docs, "PodMonitor", "kvpush-router"))
    broken["spec"]["podMetricsEndpoints"][0]["targetPort"] = 8000  # not a PodMonitor field
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, PODMONITOR_SCHEMA)


def test_the_prometheus_rule_holds_exactly_the_plain_rules_file(layout: tuple[str, list[Doc]]) -> None:
    plain = yaml.safe_load((REPO / "deploy" / "prometheus" / "rules.yml").read_text())
    assert one(layout[1], "PrometheusRule", "kvpush")["spec"]["groups"] == plain["groups"]


def test_the_committed_prometheus_rule_is_what_the_builder_makes() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "tools" / "build_alerts.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_object_lives_in_the_layout_s_namespace_and_every_image_is_pinned(
    layout: tuple[str, list[Doc]],
) -> None:
    docs = layout[1]
    (namespace,) = [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"]
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == namespace, f"{doc['kind']}/{doc['metadata']['name']}"
    for template in pod_templates(docs):
        for c in template["spec"]["containers"]:
            name, _, tag = c["image"].rpartition(":")
            assert name and tag and tag != "latest", f"{c['name']}: image {c['image']!r} has no pinned tag"


def test_an_overlay_can_move_every_layout_to_another_namespace(tmp_path: Path) -> None:
    for name, path in LAYOUTS.items():
        overlay = tmp_path / name
        overlay.mkdir()
        (overlay / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "namespace": "llm-serving",
                    "resources": [os.path.relpath(path, overlay)],
                }
            )
        )
        docs = render(overlay)
        assert one(docs, "Namespace", "llm-serving")
        for doc in docs:
            if doc["kind"] != "Namespace":
                assert doc["metadata"]["namespace"] == "llm-serving", f"{name}: {doc['kind']}"
        subjects = one(docs, "RoleBinding", "kvpush-router-pod-reader")["subjects"]
        assert [s["namespace"] for s in subjects] == ["llm-serving"], f"{name}: the binding stays behind"


# --- the pools -------------------------------------------------------------------------------------------------


def kv_config(c: Doc) -> Doc:
    args = c["args"]
    return dict(json.loads(args[args.index("--kv-transfer-config") + 1]))


@pytest.mark.parametrize(("pool", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_vllm_pools_run_the_push_connector_with_their_own_nixl_identity(
    layout: tuple[str, list[Doc]], pool: str, kv_role: str
) -> None:
    spec = one(layout[1], "Deployment", f"kvpush-{pool}")["spec"]["template"]["spec"]
    vllm = container(spec, "vllm")
    config = kv_config(vllm)
    if layout[0] == "kvpush-connector":  # ours, from the image deploy/vllm/Dockerfile builds
        assert (config["kv_connector"], config["kv_connector_module_path"]) == ("KvpushConnector", "connector.plugin")
        assert vllm["image"].startswith("kvpush/vllm:")
    else:  # vLLM's own: nothing to add to the image
        assert config["kv_connector"] == "NixlPushConnector"
        assert "kv_connector_module_path" not in config
        assert vllm["image"].startswith("vllm/vllm-openai:")
    assert config["kv_role"] == kv_role
    assert config["engine_id"] == "$(POD_NAME)"  # one engine id per pod, expanded by the kubelet
    env = env_of(vllm)
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == ports_of(vllm)["nixl-side"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
    port = f"--port={ports_of(vllm)['vllm']}"
    assert port in vllm["args"], f"vLLM must listen on its named port vllm: {port} not in {vllm['args']}"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": "vllm"}
    for name, ref in ((e["name"], e.get("valueFrom", {})) for e in vllm["env"]):
        if "$(" + name + ")" in " ".join(vllm["args"]):
            assert ref or name in env, f"{name} is used in args but not defined"


def test_headless_pool_services_expose_the_pool_ports(layout: tuple[str, list[Doc]]) -> None:
    docs = layout[1]
    for pool in ("prefill", "decode"):
        service = one(docs, "Service", f"kvpush-{pool}")
        assert service["spec"]["clusterIP"] == "None"
        assert {p["name"] for p in service["spec"]["ports"]} >= {"vllm", "nixl-side"}


def test_every_service_targets_named_ports_its_pods_have(layout: tuple[str, list[Doc]]) -> None:
    docs = layout[1]
    for service in (d for d in docs if d["kind"] == "Service"):
        pods = [t for t in pod_templates(docs) if selects(service["spec"]["selector"], t["metadata"]["labels"])]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for pod in pods:
                named = {n for c in pod["spec"]["containers"] for n in ports_of(c)}
                assert port["targetPort"] in named, f"{service['metadata']['name']}: {port} not on the pods"


def test_pod_monitors_find_their_ports(layout: tuple[str, list[Doc]]) -> None:
    docs = layout[1]
    expected = {"kvpush-router": {"router"}, "kvpush-vllm": {"vllm"}}
    for name, containers in expected.items():
        monitor = one(docs, "PodMonitor", name)
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        scraped = {
            c["name"]
            for t in pod_templates(docs)
            if selects(monitor["spec"]["selector"]["matchLabels"], t["metadata"]["labels"])
            for c in t["spec"]["containers"]
            if endpoint["port"] in ports_of(c)
        }
        assert scraped == containers, f"{name} scrapes the containers {scraped}"
        relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
        assert relabel["job"]["replacement"] == name  # the job names the alert rules use
        assert relabel["pool"]["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]


# --- the router ------------------------------------------------------------------------------------------------


def router_pod(name: str, docs: list[Doc]) -> Doc:
    deployment = "kvpush-decode" if name in SIDECAR else "kvpush-router"
    return dict(one(docs, "Deployment", deployment)["spec"]["template"]["spec"])


def router_settings(pod: Doc, docs: list[Doc], tmp_path: Path) -> Any:
    router = container(pod, "router")
    (mount,) = router["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
    config_arg = router["args"][router["args"].index("--config") + 1]
    assert Path(config_arg).parent == Path(mount["mountPath"])
    path = tmp_path / "router.yaml"
    path.write_text(config_map["data"][Path(config_arg).name])
    argv = [str(path) if a == config_arg else a for a in router["args"]]
    assert argv[0] == "serve"  # the image's entrypoint is `kvpush`
    return load_serve_settings(argv[1:], {})


def test_the_router_config_map_loads_with_the_router_s_own_loader(
    layout: tuple[str, list[Doc]], tmp_path: Path
) -> None:
    name, docs = layout
    pod = router_pod(name, docs)
    settings = router_settings(pod, docs, tmp_path)
    router = container(pod, "router")
    assert settings.host == "0.0.0.0"
    assert settings.port == ports_of(router)["http"]
    assert str(settings.mode) == "push"
    from router.discovery.settings import KubernetesConfig, parse_discovery

    discovered = {str(c.role): c for c in parse_discovery(settings.discovery)}
    roles = {"prefill": "kvpush-prefill", "decode": "kvpush-decode"}
    for role, deployment in roles.items():
        template = one(docs, "Deployment", deployment)["spec"]["template"]
        vllm_port = ports_of(container(template["spec"], "vllm"))["vllm"]
        if role == "decode" and name in SIDECAR:  # the sidecar decodes on its own pod's vLLM
            assert [w.url for w in settings.decode] == [f"http://127.0.0.1:{vllm_port}"]
            continue
        source = discovered[role]  # every Ready pod of the pool, from the Kubernetes API
        assert isinstance(source, KubernetesConfig) and source.port == vllm_port
        wanted = dict(pair.split("=") for pair in source.selector.split(","))
        assert wanted.items() <= template["metadata"]["labels"].items(), f"{role} selector matches its pods"


def test_the_router_is_probed_on_ready_and_health_and_runs_unprivileged(layout: tuple[str, list[Doc]]) -> None:
    name, docs = layout
    pod = router_pod(name, docs)
    router = container(pod, "router")
    assert router["image"].startswith("kvpush/router:")
    assert router["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    security = {**pod.get("securityContext", {}), **router["securityContext"]}
    assert security["runAsNonRoot"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert pod["serviceAccountName"] == "kvpush-router"


def test_layouts_place_the_router_where_they_say(layout: tuple[str, list[Doc]]) -> None:
    name, docs = layout
    decode = one(docs, "Deployment", "kvpush-decode")["spec"]["template"]["spec"]
    names = [c["name"] for c in decode["containers"]]
    frontdoor = one(docs, "Service", "kvpush")["spec"]["selector"]["app.kubernetes.io/component"]
    if name in SIDECAR:
        assert names == ["vllm", "router"]
        assert frontdoor == "decode"
        assert not any(d["kind"] == "Deployment" and d["metadata"]["name"] == "kvpush-router" for d in docs)
    else:
        assert names == ["vllm"]
        assert frontdoor == "router"
        assert "router-config" not in {v["name"] for v in decode["volumes"]}
        assert decode.get("automountServiceAccountToken") is False


def test_the_router_may_discover_pods_and_nothing_more(layout: tuple[str, list[Doc]]) -> None:
    docs = layout[1]
    role = one(docs, "Role", "kvpush-router-pod-reader")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = one(docs, "RoleBinding", "kvpush-router-pod-reader")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    namespace = one(docs, "ServiceAccount", "kvpush-router")["metadata"]["namespace"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvpush-router", "namespace": namespace}]


def test_everything_a_pod_references_is_in_the_layout(layout: tuple[str, list[Doc]]) -> None:
    docs = layout[1]
    config_maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"} | {"default"}
    for template in pod_templates(docs):
        spec = template["spec"]
        assert spec.get("serviceAccountName", "default") in accounts
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["name"] in config_maps
                    assert ref["key"] in one(docs, "ConfigMap", ref["name"])["data"]
            mounted = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounted <= {v["name"] for v in spec.get("volumes", [])}


def prestop_sleep(c: Doc) -> float:
    command = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


def test_the_pod_outlives_the_router_s_drain(layout: tuple[str, list[Doc]], tmp_path: Path) -> None:
    name, docs = layout
    pod = router_pod(name, docs)
    settings = router_settings(pod, docs, tmp_path)
    drain = prestop_sleep(container(pod, "router")) + settings.drain_delay + settings.drain_grace
    assert pod["terminationGracePeriodSeconds"] > drain
    if name in SIDECAR:  # the decode engine must keep serving the sidecar's streams until the drain is over
        assert prestop_sleep(container(pod, "vllm")) > drain


def test_the_readme_s_own_overlay_example_renders_and_replaces_the_model(tmp_path: Path) -> None:
    readme = (REPO / "deploy" / "README.md").read_text()
    (block,) = [b for b in readme.split("```yaml\n")[1:] if b.startswith("# my-kvpush/kustomization.yaml")]
    example = yaml.safe_load(block.split("```")[0])
    overlay = tmp_path / "my-kvpush"
    overlay.mkdir()
    example["resources"] = [os.path.relpath(REPO / r.removeprefix("../"), overlay) for r in example["resources"]]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(example))
    docs = render(overlay)
    (engine,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvpush-engine")]
    assert engine["data"]["KVPUSH_MODEL"] == "Qwen/Qwen3-32B"
    router = container(one(docs, "Deployment", "kvpush-decode")["spec"]["template"]["spec"], "router")
    assert router["image"] == "registry.example.com/ml/kvpush-router:0.1.0"
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {example["namespace"]}


# Upstream push (vLLM 0.32-0.34 NixlPushConnector) keeps a finished prefill's blocks for kv_lease_duration
# (default 30 s) and decode heartbeats do not renew it (vllm#53095); kvpush's connector has lease_s (30 s).
# A decode that registers after the lease gets nothing, so the lease must outlast the router's own wait for
# decode's first byte: after that deadline the router has given the request up anyway.
LEASE_KEYS = {"NixlPushConnector": "kv_lease_duration", "KvpushConnector": "lease_s"}


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_the_prefill_lease_outlasts_the_router_s_decode_deadline(
    layout: tuple[str, list[Doc]], pool: str, tmp_path: Path
) -> None:
    name, docs = layout
    settings = router_settings(router_pod(name, docs), docs, tmp_path)
    vllm = container(one(docs, "Deployment", f"kvpush-{pool}")["spec"]["template"]["spec"], "vllm")
    config = kv_config(vllm)
    lease = config["kv_connector_extra_config"][LEASE_KEYS[config["kv_connector"]]]
    assert lease >= settings.timeouts.decode_first_byte, f"{name}: {pool} lease {lease} s"
