"""The whole local P/D stack (`kvpush stack`, `make run`): tiny model, one prefill and one decode vLLM, the router.

Start-up order: build the model once into the cache folder, start prefill (core 0) and decode (core 1)
together, wait for both /health, start the router, wait for its /ready, then print one ready line with a
curl example and stay up. Ctrl-C or SIGTERM stops every child process group; a child that fails to start
or dies later is reported with the tail of its log and a non-zero exit status.

    python -m stack.local [--mode push|pull] [--connector auto|upstream|kvpush] [--port 8000] ...
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
from stack.engines import REPO_ROOT, Engine, EngineSpec, Fleet
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

    @property
    def model_dir(self) -> Path:
        return self.cache_dir / "models" / self.model_size

    @property
    def log_dir(self) -> Path:
        return self.cache_dir / "logs"


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
    )
    return prefill, decode


def plan_router(options: StackOptions, prefill: EngineSpec, decode: EngineSpec) -> RouterSpec:
    """The router of the local stack for resolved engine specs (the prefill SPEC names P's NIXL identity)."""
    return router_spec(options.port, options.mode, [prefill], [decode], name="router")


def stack_ports(options: StackOptions, engines: Sequence[EngineSpec]) -> list[int]:
    """Every loopback port the stack will listen on: the router's, each engine's HTTP and side channel."""
    ports = [options.port]
    for spec in engines:
        ports += [spec.http_port] + ([spec.side_port] if spec.side_port else [])
    return ports


def ready_line(options: StackOptions, prefill_url: str, decode_url: str) -> str:
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
    return (
        f"kvpush stack ready: router http://{LOOPBACK}:{options.port} (mode {options.mode}, connector "
        f"{connector_for(options.mode, options.connector)[0]}; prefill {prefill_url}, decode {decode_url}; "
        f"logs {options.log_dir}); "
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
    make_router: Callable[[], ManagedProcess],
    *,
    startup_timeout: float,
    announce: Callable[[], str],
    poll_interval: float = 1.0,
) -> int:
    """Start engines, then the router, print announce() once all are ready, supervise until one exits.

    Returns 1 when a child fails to start or exits; StopRequested propagates to the caller (the fleet's
    owner stops everything on the way out).
    """
    try:
        for engine in engines:
            fleet.start(engine)
        fleet.wait_all_healthy(startup_timeout)
        router = fleet.start(make_router())
        router.wait_healthy(startup_timeout)
    except StartupError as exc:
        _say(str(exc))
        return 1
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
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument("--model-size", choices=sorted(tiny_model.SIZES), default="tiny")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="model and logs (default .cache/kvpush)")
    p.add_argument("--prefill-port", type=int, default=8100)
    p.add_argument("--decode-port", type=int, default=8200)
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for each start-up wait")
    args = p.parse_args(argv)
    if args.mode == "pull" and args.connector == "kvpush":
        p.error("the kvpush connector is push only: use --connector upstream (or auto) with --mode pull")
    return StackOptions(
        mode=args.mode,
        connector=args.connector,
        port=args.port,
        model_size=args.model_size,
        cache_dir=args.cache_dir.resolve(),
        prefill_port=args.prefill_port,
        decode_port=args.decode_port,
        startup_timeout=args.startup_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kvpush stack`: returns 0 after a requested stop, 1 when any child failed."""
    options = parse_args(argv)
    return run_supervised(options.log_dir, lambda fleet: _serve(options, fleet))


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


def _serve(options: StackOptions, fleet: Fleet) -> int:
    ensure_model(options)
    prefill, decode = (Engine(s, log_dir=options.log_dir, python=options.python) for s in plan_engines(options))
    busy = [port for port in stack_ports(options, [prefill.engine_spec, decode.engine_spec]) if not port_is_free(port)]
    if busy:
        _say(f"ports already in use on {LOOPBACK}: {busy}; is another stack running? (see --port, --prefill-port)")
        return 1
    _say(f"starting prefill {prefill.url} and decode {decode.url} (about a minute); logs in {options.log_dir}")
    spec = plan_router(options, prefill.engine_spec, decode.engine_spec)
    return run_stack(
        fleet,
        [prefill, decode],
        lambda: Router(spec, log_dir=options.log_dir, python=options.python),
        startup_timeout=options.startup_timeout,
        announce=lambda: ready_line(options, prefill.url, decode.url),
    )


def _say(message: str) -> None:
    print(f"kvpush stack: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
