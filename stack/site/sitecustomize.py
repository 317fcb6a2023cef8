"""Test and local-stack harness for vLLM processes on a small CPU box; inert unless its switches are set.

Loaded by Python at start-up when `stack/site` is on PYTHONPATH (stack.engines puts it there for every
vLLM process it starts, and every process vLLM spawns inherits it). Independent switches:

KVPUSH_NIXL_NO_PROG_THREAD=1
    Every `nixl_agent_config` built without explicit values gets `enable_prog_thread=False` and
    `sync_mode=NIXL_THREAD_SYNC_STRICT`. NIXL's UCX progress thread busy-spins (about one core per agent),
    which two engines on two cores cannot afford, and vLLM offers no switch for it. Without that thread
    NIXL picks single-threaded UCX, so the agent must serialize calls itself (STRICT): vLLM's push writer
    thread and the engine thread call it concurrently, and with the default (NONE) push wedges under load.
    The patch is applied when the NIXL backend module (`nixl_cu13._api` / `nixl_cu12._api`) is first
    imported, so processes that never import NIXL pay nothing.

KVPUSH_NIXL_PTHR_DELAY_US=N (N >= 1)
    Every NIXL agent is built with `pthrDelay` = N µs instead of the 0 NIXL's Python API hard-codes. With a
    progress thread, 0 makes it poll() UCX's event fds with a 0 ms timeout (a busy loop, about a core);
    N >= 1 makes it sleep until UCX has work or ceil(N µs) ms passed (about 2 % of a core idle). The
    emulated link (stack/link) sets it instead of KVPUSH_NIXL_NO_PROG_THREAD: over TCP a WRITE needs the
    target to progress UCX while the data arrives (research turn3-netem.md 4.3).

KVPUSH_KEEP_AFFINITY=1
    `os.sched_setaffinity` requests are clamped to the cores this process was started with (the
    `taskset -c CORE` around each engine). vLLM's CPU NIXL worker moves its forward-pass thread to the
    last core of each NUMA node; on a two-core box that is the other engine's core and prefill hangs.
    A request that shares no core with the start set is narrowed to the whole start set.
    With KVPUSH_KEEP_AFFINITY_CORES=LIST (comma-separated core ids) the allowed set is LIST instead of the
    start set: an engine that starts on every core and is pinned to its own once ready (stack.engines,
    `spread_start`) keeps vLLM's moves on its own core from the start.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

_NIXL_API_MODULES = frozenset({"nixl_cu13._api", "nixl_cu12._api"})


def _patch_agent_config(api: ModuleType) -> None:
    """Make enable_prog_thread=False and sync_mode=STRICT the defaults of api.nixl_agent_config."""
    config_cls = api.nixl_agent_config
    original_init = config_cls.__init__
    signature = inspect.signature(original_init)
    strict = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments.setdefault("enable_prog_thread", False)
        if bound.arguments.get("sync_mode") is None:
            bound.arguments["sync_mode"] = strict
        original_init(*bound.args, **bound.kwargs)

    config_cls.__init__ = __init__


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the named modules through the other finders and runs `patch` right after each executes."""

    def __init__(self, names: Iterable[str], patch: Callable[[ModuleType], None]) -> None:
        self._names = frozenset(names)
        self._patch = patch

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._names:
            return None
        spec = self._find_elsewhere(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run_module = loader.exec_module
        patch = self._patch

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def _find_elsewhere(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


def _clamp_affinity(allowed: frozenset[int]) -> None:
    """Wrap os.sched_setaffinity so that no thread leaves the cores in `allowed`."""
    original = os.sched_setaffinity

    def sched_setaffinity(pid: int, mask: Iterable[int], /) -> None:
        wanted = set(mask) & allowed
        original(pid, wanted or allowed)

    os.sched_setaffinity = sched_setaffinity


def _patch_pthr_delay(delay_us: int) -> Callable[[ModuleType], None]:
    """A patch that builds every agent of an api module with pthrDelay = delay_us."""

    def patch(api: ModuleType) -> None:
        bindings = api.nixlBind
        original = bindings.nixlAgent

        def nixlAgent(name: str, config: Any) -> Any:
            config.pthrDelay = delay_us
            return original(name, config)

        bindings.nixlAgent = nixlAgent

    return patch


def _nixl_patches(env: Mapping[str, str]) -> list[Callable[[ModuleType], None]]:
    """The patches of the NIXL API module that the environment's switches ask for."""
    patches = []
    if env.get("KVPUSH_NIXL_NO_PROG_THREAD") == "1":
        patches.append(_patch_agent_config)
    delay = env.get("KVPUSH_NIXL_PTHR_DELAY_US", "")
    if delay.isdigit() and int(delay) >= 1:
        patches.append(_patch_pthr_delay(int(delay)))
    return patches


def _install() -> None:
    patches = _nixl_patches(os.environ)
    if patches:

        def patch_all(api: ModuleType) -> None:
            for patch in patches:
                patch(api)

        sys.meta_path.insert(0, _PatchOnImport(_NIXL_API_MODULES, patch_all))
    if os.environ.get("KVPUSH_KEEP_AFFINITY") == "1" and hasattr(os, "sched_setaffinity"):
        cores = _cores(os.environ.get("KVPUSH_KEEP_AFFINITY_CORES", ""))
        _clamp_affinity(cores or frozenset(os.sched_getaffinity(0)))


def _cores(listed: str) -> frozenset[int]:
    """The core ids of a comma-separated list ("0", "0,1"); empty when it is not one."""
    parts = [p.strip() for p in listed.split(",")]
    return frozenset(int(p) for p in parts) if all(p.isdigit() for p in parts) else frozenset()


_install()
