"""The whole local P/D stack (`kvpush stack`, `make run`): tiny model, one prefill and one decode vLLM, the router.

Start-up order: build the model once into the cache folder, start prefill (core 0) and decode (core 1)
together, wait for both /health, start the router, wait for its /ready, then print one ready line with a
curl example and stay up. Ctrl-C or SIGTERM stops every child process group; a child that fails to start
or dies later is reported with the tail of its log and a non-zero exit status.

    python -m stack.local [--mode push|pull] [--connector auto|upstream|kvpush] [--port 8000] ...
    python -m stack.local --link ethernet-25g-like    # engines in their own namespaces behind a shaped link

With `--link PRESET` (stack/link) prefill and decode each run in a network namespace of their own behind a shaped
NIC, KV over UCX TCP; once both are up the stack times P's prefill of `--link-prompt-tokens` tokens and sets the
rate so that one prompt's KV transfer lasts the preset's share of it, then prints the rate in the ready line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Literal

from stack import tiny_model
from stack.engines import KV_EVENT_OFFSETS, REPO_ROOT, Engine, EngineSpec, Fleet
from stack.link.access import (
    LinkUnavailable,
    can_admin_network,
    require_access,
    user_namespace_argv,
    user_namespaces_work,
)
from stack.link.calibrate import Calibration, calibrate
from stack.link.fabric import Link
from stack.link.holders import NetnsError
from stack.link.plan import PRESETS, nominal_prefill_s, preset, resolve
from stack.procs import LOOPBACK, ManagedProcess, StartupError, port_is_free, tail_lines
from stack.routers import Router, RouterSpec, router_spec

Mode = Literal["push", "pull"]
ConnectorChoice = Literal["auto", "upstream", "kvpush"]

DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "kvpush"
PREFILL_ENGINE_ID = "kvpush-local-prefill"
# Our connector, loaded by vLLM through kv_connector_module_path. The class name is the connector
# helper's to confirm; change it here only.
KVPUSH_CONNECTOR_MODULE = "connector.plugin"
KVPUSH_CONNECTOR_CLASS = "KvpushConnector"
UPSTREAM_CONNECTORS: dict[Mode, str] = {"push": "NixlPushConnector", "pull": "NixlConnector"}
# Upstream push releases a finished prefill's blocks after kv_lease_duration (30 s by default, and heartbeats do not
# renew it): the stack sets it above the router's decode_first_byte deadline (120 s), as deploy/ does.
UPSTREAM_PUSH_LEASE_S = 150
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclasses.dataclass(frozen=True)
class StackOptions:
    """Everything `kvpush stack` can be told; the defaults are the documented local stack."""

    mode: Mode = "push"
    connector: ConnectorChoice = "auto"  # push: ours (kvpush); pull: upstream's (ours is push only)
    port: int = 8000
    model_size: str = "tiny"
    cache_dir: Path = DEFAULT_CACHE_DIR
    prefill_port: int = 8100
    decode_port: int = 8200
    prefill_side_port: int = 5600
    decode_side_port: int = 5601
    startup_timeout: float = 300.0
    python: str = sys.executable
    link: str | None = None  # a stack.link preset: engines in their own namespaces behind a shaped link
    link_prompt_tokens: int = 1024  # the prompt length whose KV transfer the preset's share is about
    replicas: int = 1  # router replicas on port, port + 1, ...; more than one: KV events on and the decider
    kv_events: bool = False  # engines publish KV events, every router follows them (on with replicas > 1)

    @property
    def events(self) -> bool:
        return self.kv_events or self.replicas > 1

    @property
    def router_ports(self) -> list[int]:
        return [self.port + i for i in range(self.replicas)]

    @property
    def model_dir(self) -> Path:
        return self.cache_dir / "models" / self.model_size

    @property
    def log_dir(self) -> Path:
        return self.cache_dir / "logs"

    @property
    def router_config_path(self) -> Path:
        return self.log_dir / "router-decider.yaml"


def connector_for(mode: Mode, choice: ConnectorChoice) -> tuple[str, str | None]:
    """(kv_connector class name, kv_connector_module_path) for a mode and connector choice."""
    if choice == "kvpush" and mode == "pull":
        raise ValueError("the kvpush connector is push only: use --connector upstream (or auto) with --mode pull")
    if choice == "kvpush" or (choice == "auto" and mode == "push"):
        return KVPUSH_CONNECTOR_CLASS, KVPUSH_CONNECTOR_MODULE
    return UPSTREAM_CONNECTORS[mode], None


def plan_engines(options: StackOptions) -> tuple[EngineSpec, EngineSpec]:
    """The prefill (core 0, fixed engine id) and decode (core 1) specs of the local stack."""
    connector, module = connector_for(options.mode, options.connector)
    extra = {"kv_lease_duration": UPSTREAM_PUSH_LEASE_S} if connector == UPSTREAM_CONNECTORS["push"] else {}
    prefill = EngineSpec(
        name="prefill",
        role="prefill",
        model=options.model_dir,
        http_port=options.prefill_port,
        core=0,
        side_port=options.prefill_side_port,
        connector=connector,
        connector_module=module,
        engine_id=PREFILL_ENGINE_ID,
        kv_role="kv_producer",
        connector_extra=extra,
        kv_events=KV_EVENT_OFFSETS if options.events else None,
    )
    decode = EngineSpec(
        name="decode",
        role="decode",
        model=options.model_dir,
        http_port=options.decode_port,
        core=1,
        side_port=options.decode_side_port,
        connector=connector,
        connector_module=module,
        kv_role="kv_consumer",
        connector_extra=extra,
        kv_events=KV_EVENT_OFFSETS if options.events else None,
    )
    return prefill, decode


def plan_router(options: StackOptions, prefill: EngineSpec, decode: EngineSpec, replica: int = 0) -> RouterSpec:
    """Router replica `replica` of the local stack for resolved engine specs (the prefill SPEC names P's NIXL
    identity), on port + replica. With KV events it follows both engines' events (the engines' offsets) and runs
    the session-affinity decider, so any replica can serve any turn of a conversation."""
    flags: list[str] = []
    config: Path | None = None
    if options.events:
        offset, replay = KV_EVENT_OFFSETS
        flags = ["--kv-events", "--kv-events-port-offset", str(offset), "--kv-events-replay-offset", str(replay)]
        config = options.router_config_path  # the decider with its options: written by write_router_config
    name = "router" if options.replicas == 1 else f"router{replica}"
    port = options.router_ports[replica]
    return router_spec(port, options.mode, [prefill], [decode], *flags, name=name, config=config)


def router_config(options: StackOptions) -> dict[str, object]:
    """The routers' YAML settings with KV events on: the session-affinity decider with the model's tokenizer, so a
    replica checks an answer another replica relayed against the token ids the engine stored (router/README.md,
    "Answers another replica relayed")."""
    return {"decider": {"name": "session-affinity", "tokenizer": str(options.model_dir)}}


def write_router_config(options: StackOptions) -> None:
    """Write router_config() where plan_router's routers read it (JSON is YAML); nothing without KV events."""
    if options.events:
        options.router_config_path.parent.mkdir(parents=True, exist_ok=True)
        options.router_config_path.write_text(json.dumps(router_config(options), indent=2) + "\n")


def plan_routers(options: StackOptions, prefill: EngineSpec, decode: EngineSpec) -> list[RouterSpec]:
    return [plan_router(options, prefill, decode, i) for i in range(options.replicas)]


def stack_ports(options: StackOptions, engines: Sequence[EngineSpec]) -> list[int]:
    """Every loopback port the stack will listen on: the router's, each engine's HTTP and side channel."""
    ports = list(options.router_ports)
    for spec in engines:
        ports += [spec.http_port] + ([spec.side_port] if spec.side_port else []) + spec.kv_event_ports()
    return ports


def link_words(calibration: Calibration) -> str:
    """The ready line's part about the link: preset, rate, and what it was derived from."""
    plan = calibration.plan
    if plan.shaping is None:
        return f"link {plan.preset.name}: not shaped"
    words = (
        f"link {plan.preset.name}: {plan.shaping.rate_bit_s / 1e6:.1f} Mbit/s, a {plan.kv_bytes // 1024} KiB KV "
        f"transfer ~{plan.shaping.wire_seconds(plan.kv_bytes) * 1e3:.0f} ms = {plan.preset.share:g} x the measured "
        f"prefill of {plan.prefill_s * 1e3:.0f} ms"
    )
    return words if plan.faithful else words + " (above ~5 Gbit/s: this box, not the shaper, sets the pace)"


def ready_line(options: StackOptions, prefill_url: str, decode_url: str, calibration: Calibration | None = None) -> str:
    """The single line printed once the router is ready: where things are and a curl to try."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "def fib(n):"}],
        "max_tokens": 32,
        "stream": True,
    }
    curl = (
        f"curl -N http://{LOOPBACK}:{options.port}/v1/chat/completions "
        f"-H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}"
    )
    routers = ", ".join(f"http://{LOOPBACK}:{port}" for port in options.router_ports)
    events = "; KV events on" if options.events else ""
    return (
        f"kvpush stack ready: router{'s' if options.replicas > 1 else ''} {routers} (mode {options.mode}, connector "
        f"{connector_for(options.mode, options.connector)[0]}; prefill {prefill_url}, decode {decode_url}; "
        f"logs {options.log_dir}{events}"
        f"{'; ' + link_words(calibration) if calibration else ''}); "
        f"try: {curl}"
    )


def ensure_model(options: StackOptions) -> Path:
    """Build the tiny model into the cache unless it is there; in a child so torch stays out of this process."""
    if tiny_model.is_built(options.model_dir, options.model_size):
        return options.model_dir
    log_path = options.log_dir / "model.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _say(f"building the {options.model_size} model into {options.model_dir} ...")
    argv = [options.python, "-m", "stack.tiny_model", str(options.model_dir), "--size", options.model_size]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    with log_path.open("wb") as log:
        done = subprocess.run(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    code = done.returncode
    if code != 0:
        raise StartupError("model build", f"exited with status {code}", log_path, tail_lines(log_path, 40))
    return options.model_dir


class StopRequested(BaseException):
    """Raised in the main thread when SIGTERM or SIGINT arrives while stop_signals() is active."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    # Ignore repeats so that a second Ctrl-C cannot interrupt the shutdown that this one starts.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise StopRequested(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGINT into StopRequested for the duration; restores the previous handlers."""
    previous = {sig: signal.signal(sig, _raise_stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_stack(
    fleet: Fleet,
    engines: Sequence[ManagedProcess],
    make_router: Callable[[], ManagedProcess | Sequence[ManagedProcess]],
    *,
    startup_timeout: float,
    announce: Callable[[], str],
    poll_interval: float = 1.0,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Start engines, then the router (or its replicas), print announce() once all are ready, supervise until one
    exits.

    Returns 1 when a child fails to start or exits; StopRequested propagates to the caller (the fleet's
    owner stops everything on the way out). `on_ready` runs once everything is ready, before announce().
    """
    try:
        for engine in engines:
            fleet.start(engine)
        fleet.wait_all_healthy(startup_timeout)
        made = make_router()
        routers = [made] if isinstance(made, ManagedProcess) else list(made)
        for router in routers:
            fleet.start(router)
        for router in routers:
            router.wait_healthy(startup_timeout)
    except StartupError as exc:
        _say(str(exc))
        return 1
    if on_ready is not None:
        on_ready()
    print(announce(), flush=True)
    while True:
        gone = fleet.exited()
        if gone:
            for member in gone:
                tail = "\n".join(f"    {line}" for line in member.log_tail(40))
                _say(f"{member.name} exited with status {member.exit_code()}; last lines of {member.log_path}:\n{tail}")
            return 1
        time.sleep(poll_interval)


def parse_args(argv: Sequence[str] | None) -> StackOptions:
    p = argparse.ArgumentParser(prog="kvpush stack", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["push", "pull"], default="push")
    p.add_argument(
        "--connector",
        choices=["auto", "upstream", "kvpush"],
        default="auto",
        help="kvpush: ours (connector.plugin, push only); upstream: vLLM's NixlPushConnector (push) / "
        "NixlConnector (pull); auto (default): kvpush for push, upstream for pull",
    )
    p.add_argument("--port", type=int, default=8000, help="router port (replicas: port, port + 1, ...)")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="router replicas sharing the engines (more than one: KV events on, session-affinity decider)",
    )
    p.add_argument(
        "--kv-events",
        action="store_true",
        help="engines publish KV events on their HTTP port + 1000 (replay + 2000); the routers follow them",
    )
    p.add_argument("--model-size", choices=sorted(tiny_model.SIZES), default="tiny")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="model and logs (default .cache/kvpush)")
    p.add_argument("--prefill-port", type=int, default=8100)
    p.add_argument("--decode-port", type=int, default=8200)
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for each start-up wait")
    p.add_argument(
        "--link",
        choices=sorted(PRESETS),
        help="engines in their own network namespaces behind a shaped link: the preset is how long one "
        "prompt's KV transfer lasts against one prefill (efa-like 3.8 %%, ethernet-100g-like ~1x, "
        "ethernet-25g-like ~4.4x), resolved from the prefill measured once the engines are up",
    )
    p.add_argument("--link-prompt-tokens", type=int, default=1024, help="prompt length the --link rate is for")
    args = p.parse_args(argv)
    if args.mode == "pull" and args.connector == "kvpush":
        p.error("the kvpush connector is push only: use --connector upstream (or auto) with --mode pull")
    if not 1 <= args.link_prompt_tokens < 2048:
        p.error("--link-prompt-tokens must be between 1 and 2047 (the engines' --max-model-len is 2048)")
    if not 1 <= args.replicas <= 4:
        p.error("--replicas must be between 1 and 4")
    return StackOptions(
        replicas=args.replicas,
        kv_events=args.kv_events,
        mode=args.mode,
        connector=args.connector,
        port=args.port,
        model_size=args.model_size,
        cache_dir=args.cache_dir.resolve(),
        prefill_port=args.prefill_port,
        decode_port=args.decode_port,
        startup_timeout=args.startup_timeout,
        link=args.link,
        link_prompt_tokens=args.link_prompt_tokens,
    )


USERNS_FLAG = "KVPUSH_STACK_IN_USERNS"  # set when `kvpush stack --link` re-ran itself in a user namespace


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvpush stack`: returns 0 after a requested stop, 1 when any child failed."""
    options = parse_args(argv)
    if options.link is None:
        return run_supervised(options.log_dir, lambda fleet: _serve(options, fleet, None))
    try:
        require_access()
    except LinkUnavailable as refused:
        if can_admin_network() or os.environ.get(USERNS_FLAG) == "1" or user_namespaces_work() is not None:
            _say(str(refused))
            return 1
        _rerun_in_user_namespace(sys.argv[1:] if argv is None else argv)
    first = preset(options.link)
    kv_bytes = options.link_prompt_tokens * tiny_model.SIZES[options.model_size].kv_bytes_per_token()
    nominal = resolve(first, prefill_s=nominal_prefill_s(options.link_prompt_tokens), kv_bytes=kv_bytes)
    link = Link(nominal.shaping)
    try:
        link.open()
    except (LinkUnavailable, NetnsError) as exc:
        _say(f"cannot make the link: {exc}")
        return 1
    try:
        return run_supervised(options.log_dir, lambda fleet: _serve(options, fleet, link))
    finally:
        link.close()  # after the fleet has stopped every engine


def _rerun_in_user_namespace(argv: Sequence[str]) -> None:
    """Without root: run this stack again as root of a new user + network namespace (research 7.4)."""
    _say(
        f"not root: running inside a user namespace of its own; enter it with "
        f"`nsenter --preserve-credentials -U -n -t {os.getpid()}` to reach the router"
    )
    env = dict(os.environ, **{USERNS_FLAG: "1"})
    command = user_namespace_argv([sys.executable, "-m", "stack.local", *argv])
    os.execvpe(command[0], command, env)


def run_supervised(log_dir: Path, body: Callable[[Fleet], int]) -> int:
    """Run body with a fresh Fleet while SIGTERM/SIGINT mean "stop"; every child is stopped on the way out.

    Returns body's status, 0 after a stop signal, 1 when a start-up failed (its log tail is printed).
    """
    with stop_signals():
        try:
            with Fleet(log_dir) as fleet:
                return body(fleet)
        except StopRequested as stop:
            _say(f"stopped ({stop})")
            return 0
        except StartupError as exc:
            _say(str(exc))
            return 1


def _serve(options: StackOptions, fleet: Fleet, link: Link | None) -> int:
    ensure_model(options)
    prefill_spec, decode_spec = plan_engines(options)
    if link is not None:  # each engine on its own address in its own namespace: only the router's port is ours
        prefill_spec = dataclasses.replace(prefill_spec, place=link.add(prefill_spec.name))
        decode_spec = dataclasses.replace(decode_spec, place=link.add(decode_spec.name))
    prefill, decode = (Engine(s, log_dir=options.log_dir, python=options.python) for s in (prefill_spec, decode_spec))
    wanted = stack_ports(options, [prefill.engine_spec, decode.engine_spec]) if link is None else [options.port]
    busy = [port for port in wanted if not port_is_free(port)]
    if busy:
        _say(f"ports already in use on {LOOPBACK}: {busy}; is another stack running? (see --port, --prefill-port)")
        return 1
    _say(f"starting prefill {prefill.url} and decode {decode.url} (about a minute); logs in {options.log_dir}")
    specs = plan_routers(options, prefill.engine_spec, decode.engine_spec)
    write_router_config(options)
    measured: list[Calibration] = []

    def measure_and_shape() -> None:
        if link is not None and options.link is not None:
            _say(f"timing the prefill of {options.link_prompt_tokens} tokens to set the {options.link} rate ...")
            kv_per_token = tiny_model.SIZES[options.model_size].kv_bytes_per_token()
            try:
                measured.append(
                    calibrate(
                        link,
                        preset(options.link),
                        prefill.url,
                        prompt_tokens=options.link_prompt_tokens,
                        kv_bytes_per_token=kv_per_token,
                    )
                )
            except (OSError, RuntimeError) as exc:  # NetnsError is a RuntimeError
                raise StartupError("link calibration", str(exc), prefill.log_path, prefill.log_tail(20)) from exc

    return run_stack(
        fleet,
        [prefill, decode],
        lambda: [Router(spec, log_dir=options.log_dir, python=options.python) for spec in specs],
        startup_timeout=options.startup_timeout,
        announce=lambda: ready_line(options, prefill.url, decode.url, measured[0] if measured else None),
        on_ready=measure_and_shape,
    )


def _say(message: str) -> None:
    print(f"kvpush stack: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
