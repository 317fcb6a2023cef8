"""The tracing components: on both router layouts every router reads the generated tracing settings (which the
router's own tracing loader resolves to the collector's Service and port), every vLLM engine exports to the same
collector, the collector's pipeline is whole and forwards to the backend's Service, and without the component
nothing traces."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.tracing.settings import ENV, GRPC, parse_tracing, resolve
from tests.unit.deploy.kustomize import (
    LAYOUTS,
    REPO,
    TRACING,
    TRACING_BACKEND,
    Doc,
    container,
    env_of,
    one,
    ports_of,
    render,
)

COLLECTOR = "kvpush-otel-collector"


def with_tracing(tmp_path: Path, layout: str, backend: bool = True) -> list[Doc]:
    """`layout` with the tracing component (and the backend) added by an overlay of the reader's own."""
    overlay = tmp_path / layout
    overlay.mkdir()
    components = [TRACING, *([TRACING_BACKEND] if backend else [])]
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": "kvpush",  # the generated ConfigMap's reference is renamed within one namespace
                "resources": [os.path.relpath(LAYOUTS[layout], overlay)],
                "components": [os.path.relpath(c, overlay) for c in components],
            }
        )
    )
    return render(overlay)


def routers(docs: list[Doc]) -> list[Doc]:
    return [
        c
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] == "router"
    ]


def engines(docs: list[Doc]) -> list[Doc]:
    return [
        c
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] == "vllm"
    ]


def service_port(docs: list[Doc], url: str) -> tuple[str, int]:
    """The Service and port a cluster URL names, checked to exist and to target a port its pods have."""
    host, _, port = url.removeprefix("http://").partition(":")
    service = one(docs, "Service", host)
    (entry,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    pods = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == host]
    assert pods, f"no Deployment behind {host}"
    named = {n for c in pods[0]["spec"]["template"]["spec"]["containers"] for n in ports_of(c)}
    assert entry["targetPort"] in named
    return host, int(port)


def router_env(docs: list[Doc], router: Doc) -> dict[str, str]:
    """What the router's environment holds from its envFrom ConfigMaps."""
    out: dict[str, str] = {}
    for source in router.get("envFrom", []):
        ref = source["configMapRef"]
        out.update(one(docs, "ConfigMap", ref["name"])["data"])
    return out


@pytest.mark.parametrize("layout", ["base", "standalone"])
def test_every_router_traces_to_the_collector(tmp_path: Path, layout: str) -> None:
    docs = with_tracing(tmp_path, layout)
    found = routers(docs)
    assert found
    for router in found:
        env = router_env(docs, router)
        settings = parse_tracing(next(env[var] for var, key in ENV.items() if key == "enabled"))
        plan = resolve(settings, env)
        assert plan is not None and plan.protocol == GRPC and plan.service_name == "kvpush-router"
        assert plan.sampling.name == "parentbased_traceidratio" and 0 < plan.sampling.ratio <= 1
        assert service_port(docs, plan.endpoint) == (COLLECTOR, 4317)


@pytest.mark.parametrize("layout", ["base", "standalone", "kvpush-connector"])
def test_every_engine_exports_to_the_collector(tmp_path: Path, layout: str) -> None:
    docs = with_tracing(tmp_path, layout)
    found = engines(docs)
    assert len(found) == 2
    names = set()
    for vllm in found:
        (flag,) = [a for a in vllm["args"] if a.startswith("--otlp-traces-endpoint")]
        assert service_port(docs, flag.partition("=")[2]) == (COLLECTOR, 4317)
        names.add(env_of(vllm)["OTEL_SERVICE_NAME"]["value"])
    assert names == {"vllm-prefill", "vllm-decode"}


def collector_config(docs: list[Doc]) -> dict[str, Any]:
    deployment = one(docs, "Deployment", COLLECTOR)["spec"]["template"]["spec"]
    (volume,) = [v for v in deployment["volumes"] if "configMap" in v]
    data = one(docs, "ConfigMap", volume["configMap"]["name"])["data"]
    collector = container(deployment, "collector")
    (arg,) = [a for a in collector["args"] if a.startswith("--config=")]
    return dict(yaml.safe_load(data[Path(arg.partition("=")[2]).name]))


def test_the_collector_pipeline_is_whole_and_reaches_the_backend(tmp_path: Path) -> None:
    docs = with_tracing(tmp_path, "base")
    config = collector_config(docs)
    (pipeline,) = config["service"]["pipelines"].values()
    for part in ("receivers", "processors", "exporters"):
        assert set(pipeline[part]) <= set(config[part]), f"the pipeline names an undefined {part[:-1]}"
    grpc = config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    collector = container(one(docs, "Deployment", COLLECTOR)["spec"]["template"]["spec"], "collector")
    assert int(grpc.rpartition(":")[2]) == ports_of(collector)["otlp-grpc"]
    health = config["extensions"]["health_check"]["endpoint"]
    assert int(health.rpartition(":")[2]) == ports_of(collector)["health"]
    endpoint = config["exporters"]["otlp"]["endpoint"]
    assert service_port(docs, f"http://{endpoint}") == ("kvpush-traces", 4317)


def test_without_a_backend_the_collector_still_renders(tmp_path: Path) -> None:
    docs = with_tracing(tmp_path, "standalone", backend=False)
    assert one(docs, "Deployment", COLLECTOR)
    assert not [d for d in docs if d["metadata"]["name"] == "kvpush-traces"]


@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - {"tracing"}))
def test_without_the_component_nothing_traces(layout: str) -> None:
    docs = render(LAYOUTS[layout])
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvpush-tracing")]
    for router in routers(docs):
        assert all(s["configMapRef"].get("optional") for s in router.get("envFrom", []))
    for vllm in engines(docs):
        assert not any(a.startswith("--otlp-traces-endpoint") for a in vllm["args"])


def test_the_tracing_layout_is_the_sidecar_layout_with_both_components() -> None:
    docs = render(LAYOUTS["tracing"])
    assert one(docs, "Deployment", COLLECTOR) and one(docs, "Deployment", "kvpush-traces")
    assert [c["name"] for c in one(docs, "Deployment", "kvpush-decode")["spec"]["template"]["spec"]["containers"]] == [
        "vllm",
        "router",
    ]


def test_the_latency_panels_show_exemplars_that_link_to_the_trace_backend() -> None:
    board = json.loads((REPO / "deploy" / "grafana" / "kvpush-dashboard.json").read_text())
    with_exemplars = {
        target["expr"].split("(rate(")[1].split("_bucket")[0]
        for panel in board["panels"]
        for target in panel.get("targets", [])
        if target.get("exemplar")
    }
    assert with_exemplars == {"kvpush_ttft_seconds", "kvpush_decode_ttft_seconds", "kvpush_handoff_seconds"}
    provisioning = yaml.safe_load((REPO / "deploy" / "grafana" / "datasources.example.yaml").read_text())
    sources = {s["uid"]: s for s in provisioning["datasources"]}
    (link,) = sources["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert link["name"] == "trace_id"  # the label RequestTrace.exemplar() sets
    backend = sources[link["datasourceUid"]]
    service = one(render(LAYOUTS["tracing"]), "Service", "kvpush-traces")
    host, _, port = backend["url"].removeprefix("http://").partition(":")
    assert host.split(".")[0] == "kvpush-traces" and int(port) in {p["port"] for p in service["spec"]["ports"]}
