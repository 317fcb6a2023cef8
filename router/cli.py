"""`kvpush serve` and `python -m router [serve]`: the router's flags, its settings from file, env and flags, the server.

The umbrella `kvpush` command (stack, load, bench, ...) lives in kvpush/cli.py: the router imports no harness.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from router.config import Settings, build_settings, from_env, with_environment
from router.errors import ConfigError
from router.tracing.settings import PROTOCOLS
from router.tracing.settings import resolve as resolve_tracing

_LIMIT_FLAGS = {  # limits: what one client request may hold (router/README.md)
    "max_body_bytes": "largest request body, bytes (413 beyond; default 16 MiB)",
    "max_header_bytes": "largest sum of header names and values, bytes (431 beyond; default 32 KiB)",
    "max_headers": "most request headers (431 beyond; default 100)",
    "max_request_id_chars": "longest x-request-id kept (longer ones are replaced; default 128)",
    "max_event_bytes": "largest upstream SSE event, bytes (default 8 MiB)",
    "max_json_depth": "deepest nesting of a request's JSON (400 beyond; default 64)",
    "max_n": "most choices ('n') one request may ask for (400 beyond; default 16)",
    "max_batch_prompts": "most prompts in one batched /v1/completions request (400 beyond; default 64)",
}


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpush serve", description="Run the kvpush router.")
    p.add_argument("--config", type=Path, help="YAML settings file (flags and KVPUSH_* variables override it)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--mode", choices=["push", "pull"], help="push: both legs at once (default); pull: sequential")
    p.add_argument(
        "--prefill",
        action="append",
        metavar="SPEC",
        help="prefill worker: URL (identity learned) or URL,engine_id=ID,side_port=N[,side_host=H,tp=,pp=]; "
        "either with ,dp=N for a server with N data-parallel ranks",
    )
    p.add_argument("--decode", action="append", metavar="URL", help="decode worker base URL, or URL,dp=N (repeatable)")
    p.add_argument("--decode-policy", help="decode selection policy (default least-loaded)")
    p.add_argument("--prefill-policy", help="prefill selection policy (default least-prefill-tokens)")
    p.add_argument("--retries", type=int, help="retries with fresh ids before the client got anything (default 1)")
    p.add_argument(
        "--timeout",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="a deadline: connect, prefill, decode_first_byte, decode_total, stream_idle, health, client_body, "
        "client_write_stall, helper",
    )
    p.add_argument("--decider", help="the P/D decider (default none: the mode decides, the policies pick the workers)")
    p.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="follow the engines' KV events (engines need --kv-events-config; the kv_events: block, router/README.md)",
    )
    p.add_argument(
        "--kv-events-port-offset",
        type=int,
        metavar="N",
        help="each engine publishes KV events on its HTTP port + N (default: port 5557 on every worker's host)",
    )
    p.add_argument(
        "--kv-events-replay-offset", type=int, metavar="N", help="... and answers replays on its HTTP port + N"
    )
    for name, what in _LIMIT_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name, metavar="N", help=what)
    p.add_argument(
        "--health-interval", type=float, help=f"seconds between health probes (default {Settings.health_interval:g})"
    )
    p.add_argument(
        "--fallback",
        choices=["none", "decode-only"],
        help="with no healthy prefill worker: 'none' answers 503 (default), 'decode-only' lets decode "
        "compute the prompt",
    )
    p.add_argument("--max-in-flight", type=int, help="admission: client requests in flight at once (default 512)")
    p.add_argument("--admission-queue", type=int, help="admission: requests that may wait for a slot (default 64)")
    p.add_argument("--admission-wait", type=float, help="admission: longest wait for a slot, seconds (default 5)")
    p.add_argument("--drain-delay", type=float, help="on SIGTERM, seconds /ready is 503 before the listener closes")
    p.add_argument("--drain-grace", type=float, help="on SIGTERM, seconds requests in flight may still run")
    p.add_argument("--scrape-interval", type=float, help="seconds between scrapes of workers' /metrics (0: off)")
    p.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        metavar="KEY",
        help="a client Bearer key (repeatable; prefer KVPUSH_API_KEYS: flags show in `ps`)",
    )
    p.add_argument(
        "--gateway-prefill-header",
        choices=["off", "optional", "required"],
        help="behind a Gateway API InferencePool: take the prefill from x-prefiller-host-port (default off)",
    )
    p.add_argument(
        "--tracing",
        action=argparse.BooleanOptionalAction,
        help="OpenTelemetry tracing over OTLP (default off; OTEL_* variables configure it; docs/tracing.md)",
    )
    p.add_argument("--otlp-traces-endpoint", metavar="URL", help="where spans go (switches tracing on)")
    p.add_argument("--otlp-traces-protocol", choices=PROTOCOLS, help="grpc (default) or http/protobuf")
    p.add_argument(
        "--trace-sample-ratio",
        type=float,
        metavar="R",
        help="share of requests without a sampled parent that are traced (parentbased_traceidratio)",
    )
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--log-format", choices=["json", "text"], help="json lines (default) or plain text")
    return p


def load_serve_settings(argv: list[str], env: dict[str, str]) -> Settings:
    args = serve_parser().parse_args(argv)
    file_layer: dict[str, Any] = {}
    if args.config is not None:
        try:
            loaded = yaml.safe_load(args.config.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"--config {args.config}: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"--config {args.config}: the file must hold a mapping of settings")
        file_layer = loaded or {}
    timeouts: dict[str, str] = {}
    for item in args.timeout:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--timeout {item!r}: expected NAME=SECONDS")
        timeouts[name] = value
    flags = {
        "host": args.host,
        "port": args.port,
        "mode": args.mode,
        "prefill": args.prefill,
        "decode": args.decode,
        "decode_policy": args.decode_policy,
        "prefill_policy": args.prefill_policy,
        "retries": args.retries,
        "health_interval": args.health_interval,
        "log_level": args.log_level,
        "timeouts": timeouts or None,
        "fallback": args.fallback,
        "max_in_flight": args.max_in_flight,
        "admission_queue": args.admission_queue,
        "admission_wait": args.admission_wait,
        "drain_delay": args.drain_delay,
        "drain_grace": args.drain_grace,
        "scrape_interval": args.scrape_interval,
        "api_keys": args.api_keys,
        "log_format": args.log_format,
        "decider": args.decider,
        "limits": {k: v for k in _LIMIT_FLAGS if (v := getattr(args, k)) is not None} or None,
        "tracing": _tracing_flags(args),
        "kv_events": _kv_event_flags(args),
    }
    if args.gateway_prefill_header is not None:  # the flag sets one key of the file's gateway block
        block = file_layer.get("gateway")
        flags["gateway"] = {**(block if isinstance(block, dict) else {}), "prefill_header": args.gateway_prefill_header}
    env_layer: dict[str, Any] = from_env(env)
    return build_settings(file_layer, env_layer, flags)


def _kv_event_flags(args: argparse.Namespace) -> dict[str, Any] | None:
    """The KV-event flags as a `kv_events:` layer (merged over the file's block name by name)."""
    layer = {
        "enabled": args.kv_events,
        "port_offset": args.kv_events_port_offset,
        "replay_offset": args.kv_events_replay_offset,
    }
    return {k: v for k, v in layer.items() if v is not None} or None


def _tracing_flags(args: argparse.Namespace) -> dict[str, Any] | None:
    """The tracing flags as a `tracing:` layer; naming an endpoint switches tracing on unless --no-tracing says."""
    layer = {
        "endpoint": args.otlp_traces_endpoint,
        "protocol": args.otlp_traces_protocol,
        "sample_ratio": args.trace_sample_ratio,
    }
    layer = {k: v for k, v in layer.items() if v is not None}
    if args.tracing is not None:
        layer["enabled"] = args.tracing
    elif "endpoint" in layer:
        layer["enabled"] = True
    return layer or None


def serve(argv: list[str]) -> int:
    try:
        settings = with_environment(load_serve_settings(argv, dict(os.environ)), os.environ)
        plan = resolve_tracing(settings.tracing, os.environ)
    except ConfigError as exc:
        print(f"kvpush serve: configuration error: {exc}", file=sys.stderr)
        return 2
    from router import logs
    from router.app import create_app
    from router.tracing import provider

    logs.configure(settings.log_level, settings.log_format)
    app = create_app(settings, tracing=provider.build(plan), freeze_heap=True)
    import uvicorn

    from router.drain import DrainingServer

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        log_config=None,
        loop="uvloop",  # the event loop and the HTTP parser in C: less CPU per request (router/README.md)
        http="httptools",
        # uvicorn waits with asyncio.wait_for, which takes any number of seconds; int() made 0.9 into 0
        timeout_graceful_shutdown=settings.drain_grace,  # type: ignore[arg-type]
    )
    server = DrainingServer(config, app.state.service, settings.drain_delay)
    server.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m router [serve] [options]`: serves (a leading `serve` is accepted, as `kvpush serve` spells it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return serve(args[1:] if args[:1] == ["serve"] else args)
