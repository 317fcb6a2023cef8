"""Engine families shared across test modules: one live at a time (the box has 2 cores), keyed by what it is.

A family start costs about a minute of both cores, so modules that can run on the same engines share one start. A
module names the family it needs (a `FamilySpec`) twice: in its marks (`pytest.mark.family(SPEC)`: conftest.py
runs the modules that share a family next to each other and gives the family back after the group's last test)
and in its fixture (`family_pool.get(SPEC)`). The pool starts a family on the first `get` of its spec and hands
the same started engines to every later `get` of it; it stops it before starting another spec, when a test has
spoiled it (`Family.spoil()`: it killed an engine, say), when one of its engines has exited, or when a test asks
for a fresh one. The decision is `plan()`; `FamilyPool` carries it out; `start()` is the real start.

`UPSTREAM_PUSH` is a superset: flags that do not disturb each other (prompt-token details in the usage, KV events
published, spans exported to a receiver the family owns, vLLM's dev endpoints such as POST /reset_prefix_cache)
are on for every module that runs on it. What the modules share is the engines' state: each reads counters as
deltas, sends prompts no engine has seen (uuid-led), and a test that needs a clean prefix cache resets it.
"""

from __future__ import annotations

import contextlib
import enum
import os
import uuid
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loadtest.bench.procs import vllm_lock
from stack.engines import KV_EVENT_OFFSETS, Fleet
from stack.family import PdFamily, pd_family, start_family
from tests.integration.support import LOGS, STARTUP_TIMEOUT, metric, require_vllm, tiny_model
from tests.integration.vllm_support import Engines

if TYPE_CHECKING:  # grpc and the OTLP protobufs: imported only when a family traces
    from tests.integration.otlp_receiver import OtlpReceiver

__all__ = [
    "UPSTREAM_PUSH",
    "Family",
    "FamilyPool",
    "FamilySpec",
    "Step",
    "order_by_family",
    "plan",
    "start",
]

DETAILS = "--enable-prompt-tokens-details"  # usage.prompt_tokens_details.cached_tokens (off by default in vLLM)
FAST_EXPORT = (("OTEL_BSP_SCHEDULE_DELAY", "200"),)  # ms between the span batch processor's exports (default 5000)
DEV_MODE = (("VLLM_SERVER_DEV_MODE", "1"),)  # POST /reset_prefix_cache


@dataclass(frozen=True)
class FamilySpec:
    """What a family is, and its key in the pool: prefills on core 0 (`{label}-p0..`), one decode on core 1."""

    label: str
    connector: str
    module: str | None = None
    n_prefill: int = 1
    prefill_args: tuple[tuple[str, ...], ...] = ()  # vLLM flags of prefill i (the rest get none)
    decode_args: tuple[str, ...] = ()  # vLLM flags of the decode
    extra_args: tuple[str, ...] = ()  # vLLM flags of every engine
    connector_extra: tuple[tuple[str, Any], ...] = ()  # every engine's kv_connector_extra_config, as pairs
    kv_events: bool = False  # every engine publishes its KV events (stack.engines.KV_EVENT_OFFSETS)
    traces: bool = False  # every engine exports its spans to the family's own OTLP receiver
    env: tuple[tuple[str, str], ...] = ()  # added to every engine's environment

    def pd(self, suffix: str, otlp_endpoint: str | None = None) -> PdFamily:
        """The engine specs of one start (engine ids end in `suffix`: a fresh NIXL identity per start)."""
        traces = ("--otlp-traces-endpoint", otlp_endpoint) if otlp_endpoint else ()
        return pd_family(
            self.label,
            tiny_model(),
            self.connector,
            module=self.module,
            n_prefill=self.n_prefill,
            engine_suffix=suffix,
            prefill_args=self.prefill_args,
            decode_args=self.decode_args,
            extra_args=(*self.extra_args, *traces),
            connector_extra=dict(self.connector_extra),
            kv_events=KV_EVENT_OFFSETS if self.kv_events else None,
        )


def pairs(mapping: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A connector's extra config as the spec keeps it (hashable)."""
    return tuple(sorted(mapping.items()))


# Upstream's NixlPushConnector, two plain prefills and a decode: test_pd_e2e (upstream-push, which kills p1 last),
# multiturn, tracing/test_vllm_traces, kv_events/test_replicas and deploy/test_vllm_scrape (its p0).
UPSTREAM_PUSH = FamilySpec(
    "up",
    "NixlPushConnector",
    n_prefill=2,
    extra_args=(DETAILS,),
    kv_events=True,
    traces=True,
    env=(*DEV_MODE, *FAST_EXPORT),
)


@dataclass
class Family:
    """One started family: its engines (tests/integration/vllm_support.py `Engines`, idle KV usage read at the
    start), and the OTLP receiver its engines export to when the spec traces."""

    spec: FamilySpec
    engines: Engines
    receiver: OtlpReceiver | None = None  # when spec.traces
    spoiled: bool = False
    # whether one of its engines (the handles in `engines` now: a test that restarts an engine in place, same spec
    # and ports, under engines.fleet, puts the new handle there and the family stays usable) has exited
    exited: Callable[[], bool] = field(default=lambda: False)

    def spoil(self) -> None:
        """This family must not be handed out again (a test killed an engine or left state it cannot undo)."""
        self.spoiled = True

    @property
    def usable(self) -> bool:
        return not self.spoiled and not self.exited()


class Step(enum.Enum):
    REUSE = "reuse"  # hand out the live family
    START = "start"  # nothing live: start the spec
    RESTART = "restart"  # stop the live family, then start the spec


def plan(live: Family | None, spec: FamilySpec, fresh: bool = False) -> Step:
    """What `get(spec)` does, given the live family (pure)."""
    if live is None:
        return Step.START
    if live.spec == spec and live.usable and not fresh:
        return Step.REUSE
    return Step.RESTART


Starter = Callable[[FamilySpec], contextlib.AbstractContextManager[Family]]


class FamilyPool:
    """At most one live family; `starts` lists every start's label (what the suite paid for)."""

    def __init__(self, starter: Starter) -> None:
        self._starter = starter
        self._live: Family | None = None
        self._running = contextlib.ExitStack()
        self.starts: list[str] = []

    @property
    def live(self) -> Family | None:
        return self._live

    def get(self, spec: FamilySpec, *, fresh: bool = False) -> Family:
        """The started family of `spec`: the live one when it is that spec and usable, else a new start."""
        step = plan(self._live, spec, fresh)
        if step is Step.REUSE:
            assert self._live is not None
            return self._live
        if step is Step.RESTART:
            self.release()
        running = contextlib.ExitStack()
        with running:
            family = running.enter_context(self._starter(spec))
            self._running = running.pop_all()
        self._live = family
        self.starts.append(spec.label)
        return family

    def release(self) -> None:
        """Stop the live family, if any."""
        self._live = None
        running, self._running = self._running, contextlib.ExitStack()
        running.close()

    def __enter__(self) -> FamilyPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def start(spec: FamilySpec) -> Iterator[Family]:
    """Start a family for real, under the machine's vLLM lock (held until it stops), with its OTLP receiver first
    when it traces; every engine's idle KV usage is read once all are healthy. The engines start on both cores
    and each is pinned to its own once ready (stack.engines, spread start): the two prefills of core 0 would
    otherwise start one after the other while core 1 idles once its decode is up."""
    require_vllm()
    from tests.integration.otlp_receiver import OtlpReceiver

    with contextlib.ExitStack() as running:
        running.enter_context(vllm_lock())
        receiver = running.enter_context(OtlpReceiver()) if spec.traces else None
        env = {**os.environ, **dict(spec.env)}
        fleet = running.enter_context(Fleet(LOGS, base_env=env, spread_start=True))
        family = spec.pd(f"-{uuid.uuid4().hex[:6]}", receiver.grpc_endpoint if receiver else None)
        pd = start_family(fleet, family, STARTUP_TIMEOUT)
        engines = Engines(list(pd.prefills), pd.decode, fleet)
        engines.idle_usage = {url: metric(url, "vllm:kv_cache_usage_perc") for url in engines.urls()}
        yield Family(spec, engines, receiver, exited=lambda: any(e.exit_code() is not None for e in engines.members()))


def order_by_family(keys: Sequence[tuple[Hashable | None, bool]]) -> list[int]:
    """The run order of items given each one's (family key or None, spoils): items of one family move up to its
    first item, in their order, the ones that spoil it last; items without a family keep their place."""
    first: dict[Hashable, int] = {}
    for index, (key, _) in enumerate(keys):
        if key is not None:
            first.setdefault(key, index)

    def rank(index: int) -> tuple[int, bool, int]:
        key, spoils = keys[index]
        return (first[key] if key is not None else index, spoils, index)

    return sorted(range(len(keys)), key=rank)
