"""The router as a child process: the typed spec, its exact `python -m router serve` command, a handle.

A `RouterSpec` says what one router process is (port, mode, its prefill SPECs and decode URLs, a config file,
any further `serve` flags); `router_spec()` builds one from engine specs or strings. The pure functions
`router_argv()` and `router_process()` turn it into the command and the `ProcessSpec` (ready when GET /ready,
or the spec's `ready_path`, answers 200). `Router` runs one spec as a `ManagedProcess`, with port 0 replaced by
a free port when the handle is made, so its `url` is known before `start()`. The local stack, the benchmarks
and the integration tests start routers only through this module: a router flag changes here, once.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from stack.engines import DEFAULT_LOG_DIR, REPO_ROOT, EngineSpec
from stack.procs import LOOPBACK, ManagedProcess, ProcessSpec, free_port, http_status

__all__ = ["Router", "RouterSpec", "router_argv", "router_env", "router_process", "router_spec"]


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """One `python -m router serve` process. Port 0 means "pick a free port when the Router is made".

    `mode` None leaves the mode to the router (its default or the config file's). `flags` are further
    `serve` flags, passed verbatim after the ones this spec names (a later flag wins in the router's parser).
    `runner` is what goes between the interpreter and `router serve`: `-m` by default; a wrapper module that
    runs the module named after it fits too, e.g. `("-m", "loadtest.bench.profiled", "/tmp/router.prof")`.
    """

    name: str = "router"
    port: int = 0
    mode: str | None = None
    prefills: tuple[str, ...] = ()
    decodes: tuple[str, ...] = ()
    config: Path | None = None
    flags: tuple[str, ...] = ()
    host: str = LOOPBACK
    ready_path: str = "/ready"
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    runner: tuple[str, ...] = ("-m",)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"router {self.name!r}: port {self.port} is not a TCP port")
        if not self.ready_path.startswith("/"):
            raise ValueError(f"router {self.name!r}: ready_path must start with '/'")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def router_spec(
    port: int,
    mode: str | None,
    prefills: Sequence[str | EngineSpec],
    decodes: Sequence[str | EngineSpec],
    *flags: str,
    name: str = "router",
    config: Path | None = None,
    ready_path: str = "/ready",
    env: Mapping[str, str] | None = None,
    runner: tuple[str, ...] = ("-m",),
) -> RouterSpec:
    """A RouterSpec whose workers may be given as engine specs: a prefill as its `prefill_arg()` SPEC
    (URL plus NIXL identity), a decode as its URL; strings are passed as they are."""
    return RouterSpec(
        name=name,
        port=port,
        mode=mode,
        prefills=tuple(p.prefill_arg() if isinstance(p, EngineSpec) else p for p in prefills),
        decodes=tuple(d.url if isinstance(d, EngineSpec) else d for d in decodes),
        config=config,
        flags=flags,
        ready_path=ready_path,
        env=dict(env or {}),
        runner=runner,
    )


def router_argv(spec: RouterSpec, python: str = sys.executable) -> tuple[str, ...]:
    """The exact command for a spec whose port is resolved."""
    if spec.port == 0:
        raise ValueError(f"router {spec.name!r}: resolve the port before building the command")
    argv = [python, *spec.runner, "router", "serve", "--host", spec.host, "--port", str(spec.port)]
    if spec.config is not None:
        argv += ["--config", str(spec.config)]
    if spec.mode is not None:
        argv += ["--mode", spec.mode]
    for prefill in spec.prefills:
        argv += ["--prefill", prefill]
    for decode in spec.decodes:
        argv += ["--decode", decode]
    return (*argv, *spec.flags)


def router_env(spec: RouterSpec, base: Mapping[str, str] | None = None, repo_root: Path = REPO_ROOT) -> dict[str, str]:
    """base (default os.environ) plus the spec's own variables, with the repository first on PYTHONPATH so
    `python -m router` finds this checkout from any working directory."""
    env = {**(os.environ if base is None else base), **spec.env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root), env.get("PYTHONPATH")) if p)
    return env


def router_process(
    spec: RouterSpec, log_dir: Path, python: str = sys.executable, base_env: Mapping[str, str] | None = None
) -> ProcessSpec:
    """The ManagedProcess description of a resolved router spec: logs to `log_dir/<name>.log`."""
    return ProcessSpec(
        name=spec.name,
        argv=router_argv(spec, python),
        env=router_env(spec, base_env),
        log_path=log_dir / f"{spec.name}.log",
        ready_url=f"{spec.url}{spec.ready_path}",
        cwd=REPO_ROOT,
    )


class Router(ManagedProcess):
    """A router process: the port is resolved when the handle is made, so url is known before start()."""

    def __init__(
        self,
        spec: RouterSpec,
        *,
        log_dir: Path = DEFAULT_LOG_DIR,
        python: str = sys.executable,
        base_env: Mapping[str, str] | None = None,
        pick_port: Callable[[], int] = free_port,
        probe: Callable[[str], int | None] = http_status,
    ) -> None:
        self.router_spec = spec if spec.port else dataclasses.replace(spec, port=pick_port())
        super().__init__(router_process(self.router_spec, log_dir, python, base_env), probe=probe)

    @property
    def url(self) -> str:
        return self.router_spec.url

    @property
    def port(self) -> int:
        return self.router_spec.port
