"""OpenTelemetry tracing of the request path (off by default).

- `context`: the W3C traceparent/tracestate/baggage headers, read bounded from the client and written on both legs;
- `settings`: the `tracing:` block and the OTEL_* variables, resolved (pure);
- `semconv`: span names and attributes (GenAI semantic conventions where they exist);
- `trace`: one request's spans (server, legs with attempt numbers, handoff) over the OTel API;
- `provider`: the process's TracerProvider, sampler and OTLP exporter (gRPC or HTTP/protobuf, batched).

With tracing off the router holds no `Tracing` and no `RequestTrace` (None), and the hot path checks for None once.
"""
