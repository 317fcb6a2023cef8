"""One prefill/decode family of engines: the specs (`pd_family`) and the started handles (`start_family`).

A family is what the P/D tests and benchmarks run: prefill engines on one core and decode engines on another,
all on one KV connector, each prefill with its own engine id. `pd_family()` is pure (ports are picked when the
engines are made); `start_family()` starts every engine of a family at once under a Fleet and waits for all.
Most families have one decode engine (`.decode`); the multi-turn ones have several (`.decodes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from stack.engines import Engine, EngineSpec, Fleet
from stack.link.fabric import Link

__all__ = ["PdEngines", "PdFamily", "on_link", "pd_family", "start_family"]

_Member = TypeVar("_Member")


@dataclasses.dataclass(frozen=True)
class _Family(Generic[_Member]):
    prefills: tuple[_Member, ...]
    decodes: tuple[_Member, ...]

    @property
    def decode(self) -> _Member:
        """The family's decode engine, when it has exactly one."""
        if len(self.decodes) != 1:
            raise ValueError(f"this family has {len(self.decodes)} decode engines: use .decodes")
        return self.decodes[0]

    @property
    def members(self) -> tuple[_Member, ...]:
        """Prefills first, then decodes (the order `Fleet.start_all` returns the handles in)."""
        return (*self.prefills, *self.decodes)


class PdFamily(_Family[EngineSpec]):
    """The specs of one prefill/decode family, all on one connector."""

    @property
    def specs(self) -> tuple[EngineSpec, ...]:
        return self.members


class PdEngines(_Family[Engine]):
    """The started engines of one family, in the family's order."""

    def prefill_args(self) -> list[str]:
        """The router's `--prefill` SPECs, one per prefill engine (URL and NIXL identity)."""
        return [engine.engine_spec.prefill_arg() for engine in self.prefills]

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.members]


def pd_family(
    label: str,
    model: Path,
    connector: str,
    *,
    module: str | None = None,
    n_prefill: int = 1,
    n_decode: int = 1,
    prefill_core: int = 0,
    decode_core: int = 1,
    engine_suffix: str = "",
    decode_engine_ids: bool = False,
    prefill_args: Sequence[tuple[str, ...]] = (),
    decode_args: tuple[str, ...] = (),
    extra_args: tuple[str, ...] = (),
    connector_extra: Mapping[str, Any] | None = None,
    max_model_len: int = 2048,
    kv_events: tuple[int, int] | None = None,
) -> PdFamily:
    """Prefills `{label}-p0..` (engine ids `{label}-pN{engine_suffix}`) on prefill_core; decode `{label}-d`
    (several: `{label}-d0..`) on decode_core, with engine ids `{label}-d..{engine_suffix}` only when
    decode_engine_ids. Ports and side ports are picked when the engines are made. `extra_args` are vLLM flags
    of every engine, then `prefill_args[i]` those of prefill i (the rest get none) and `decode_args` those of
    every decode; `connector_extra` is every engine's kv_connector_extra_config; `kv_events` (offsets from each
    engine's HTTP port: stack.engines.KV_EVENT_OFFSETS) makes every engine publish its KV events."""
    if n_prefill < 1 or n_decode < 1:
        raise ValueError("a P/D family needs at least one prefill and one decode engine")
    if len(prefill_args) > n_prefill:
        raise ValueError(f"{len(prefill_args)} prefill_args for {n_prefill} prefill engines")
    per_prefill = [*prefill_args, *[()] * (n_prefill - len(prefill_args))]
    common: dict[str, Any] = {
        "model": model,
        "connector": connector,
        "connector_module": module,
        "connector_extra": dict(connector_extra or {}),
        "max_model_len": max_model_len,
        "kv_events": kv_events,
    }
    prefills = tuple(
        EngineSpec(
            name=f"{label}-p{i}",
            role="prefill",
            core=prefill_core,
            engine_id=f"{label}-p{i}{engine_suffix}",
            extra_args=(*extra_args, *per_prefill[i]),
            **common,
        )
        for i in range(n_prefill)
    )
    names = [f"{label}-d"] if n_decode == 1 else [f"{label}-d{i}" for i in range(n_decode)]
    decodes = tuple(
        EngineSpec(
            name=name,
            role="decode",
            core=decode_core,
            engine_id=f"{name}{engine_suffix}" if decode_engine_ids else None,
            extra_args=(*extra_args, *decode_args),
            **common,
        )
        for name in names
    )
    return PdFamily(prefills, decodes)


def on_link(family: PdFamily, link: Link) -> PdFamily:
    """The family with every engine given its own namespace on `link` (made now, in the family's order)."""
    placed = [dataclasses.replace(spec, place=link.add(spec.name)) for spec in family.specs]
    n = len(family.prefills)
    return PdFamily(tuple(placed[:n]), tuple(placed[n:]))


def start_family(fleet: Fleet, family: PdFamily, timeout: float, *, link: Link | None = None) -> PdEngines:
    """Start every engine of the family at once under `fleet` and wait (one deadline) until all are healthy.
    With `link` (open, and closed after the fleet stops) each engine runs in its own namespace on it."""
    if link is not None:
        family = on_link(family, link)
    engines = fleet.start_all(family.specs)
    fleet.wait_all_healthy(timeout)
    n = len(family.prefills)
    return PdEngines(tuple(engines[:n]), tuple(engines[n:]))
