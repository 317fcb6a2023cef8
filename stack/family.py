"""One prefill/decode family of engines: the specs (`pd_family`) and the started handles (`start_family`).

A family is what the P/D tests and benchmarks run: prefill engines on one core and a decode engine on another,
all on one KV connector, each prefill with its own engine id. `pd_family()` is pure (ports are picked when the
engines are made); `start_family()` starts every engine of a family at once under a Fleet and waits for all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from stack.engines import Engine, EngineSpec, Fleet

__all__ = ["PdEngines", "PdFamily", "pd_family", "start_family"]


@dataclasses.dataclass(frozen=True)
class PdFamily:
    """The specs of one prefill/decode family: prefill engines and one decode, all on one connector."""

    prefills: tuple[EngineSpec, ...]
    decode: EngineSpec

    @property
    def specs(self) -> tuple[EngineSpec, ...]:
        """Every spec, prefills first (the order `Fleet.start_all` returns the handles in)."""
        return (*self.prefills, self.decode)


def pd_family(
    label: str,
    model: Path,
    connector: str,
    *,
    module: str | None = None,
    n_prefill: int = 1,
    prefill_core: int = 0,
    decode_core: int = 1,
    engine_suffix: str = "",
    prefill_args: Sequence[tuple[str, ...]] = (),
    decode_args: tuple[str, ...] = (),
) -> PdFamily:
    """Prefills `{label}-p0..` (engine ids `{label}-pN{engine_suffix}`) on prefill_core, decode `{label}-d` on
    decode_core; ports and side ports are picked when the engines are made. `prefill_args[i]` are extra vLLM
    flags of prefill i (the rest get none); `decode_args` the decode's."""
    if n_prefill < 1:
        raise ValueError("a P/D family needs at least one prefill engine")
    if len(prefill_args) > n_prefill:
        raise ValueError(f"{len(prefill_args)} prefill_args for {n_prefill} prefill engines")
    extra = [*prefill_args, *[()] * (n_prefill - len(prefill_args))]
    prefills = tuple(
        EngineSpec(
            name=f"{label}-p{i}",
            role="prefill",
            model=model,
            core=prefill_core,
            connector=connector,
            connector_module=module,
            engine_id=f"{label}-p{i}{engine_suffix}",
            extra_args=tuple(extra[i]),
        )
        for i in range(n_prefill)
    )
    decode = EngineSpec(
        name=f"{label}-d",
        role="decode",
        model=model,
        core=decode_core,
        connector=connector,
        connector_module=module,
        extra_args=decode_args,
    )
    return PdFamily(prefills, decode)


@dataclasses.dataclass(frozen=True)
class PdEngines:
    """The started engines of one family, in the family's order."""

    prefills: tuple[Engine, ...]
    decode: Engine

    def prefill_args(self) -> list[str]:
        """The router's `--prefill` SPECs, one per prefill engine (URL and NIXL identity)."""
        return [engine.engine_spec.prefill_arg() for engine in self.prefills]

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in (*self.prefills, self.decode)]


def start_family(fleet: Fleet, family: PdFamily, timeout: float) -> PdEngines:
    """Start every engine of the family at once under `fleet` and wait (one deadline) until all are healthy."""
    engines = fleet.start_all(family.specs)
    fleet.wait_all_healthy(timeout)
    return PdEngines(tuple(engines[:-1]), engines[-1])
