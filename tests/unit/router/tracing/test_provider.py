"""The provider's parts: samplers by OTel name, the exporter of each protocol, nothing built when off."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.sampling import ParentBased, StaticSampler, TraceIdRatioBased

from router.tracing.grpc_export import LeanGrpcSpanExporter
from router.tracing.http_export import LeanHttpSpanExporter
from router.tracing.provider import build, exporter_for, sampler_for
from router.tracing.settings import GRPC, HTTP, SAMPLERS, ExportPlan, Sampling


@pytest.mark.parametrize("name", SAMPLERS)
def test_every_otel_sampler_name_builds(name: str) -> None:
    sampler = sampler_for(Sampling(name, 0.5))
    assert isinstance(sampler, ParentBased) == name.startswith("parentbased_")
    if name == "traceidratio":
        assert isinstance(sampler, TraceIdRatioBased) and sampler.rate == 0.5
    if name in ("always_on", "always_off"):
        assert isinstance(sampler, StaticSampler)


def test_unknown_sampler_is_refused() -> None:
    with pytest.raises(ValueError):
        sampler_for(Sampling("sometimes"))


def test_the_exporter_follows_the_protocol() -> None:
    grpc = exporter_for(ExportPlan("http://127.0.0.1:4317", GRPC, Sampling(), "s"))
    http = exporter_for(ExportPlan("http://127.0.0.1:4318/v1/traces", HTTP, Sampling(), "s"))
    try:
        assert isinstance(grpc, GrpcExporter) and isinstance(http, HttpExporter)
        assert isinstance(grpc, LeanGrpcSpanExporter) and isinstance(http, LeanHttpSpanExporter)  # kvpush's encoder
        assert http._endpoint == "http://127.0.0.1:4318/v1/traces"
    finally:
        grpc.shutdown()
        http.shutdown()  # type: ignore[no-untyped-call]


def test_nothing_is_built_when_off() -> None:
    assert build(None) is None
