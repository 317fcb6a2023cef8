"""``kv_connector_extra_config``: every option of the connector, parsed and checked at engine start.

``Options.from_extra`` refuses unknown keys (naming the known ones) and bad values (G9).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from connector.actions import Timeouts
from connector.handshake import Liveness


@dataclass(frozen=True)
class Polling:
    """When the owner thread wakes without being woken (seconds)."""

    write_poll_min_s: float = 0.0002  # first check of a posted WRITE
    write_poll_max_s: float = 0.005  # the check interval doubles up to this while WRITEs are in flight
    idle_wait_s: float = 0.1  # safety-net wake with nothing in flight

    def __post_init__(self) -> None:
        if not 0 < self.write_poll_min_s <= self.write_poll_max_s <= self.idle_wait_s:
            raise ValueError("need 0 < write_poll_min_s <= write_poll_max_s <= idle_wait_s")


@dataclass(frozen=True)
class Options:
    """Everything ``kv_connector_extra_config`` may set; any other key is refused."""

    timeouts: Timeouts = field(default_factory=Timeouts)
    polling: Polling = field(default_factory=Polling)
    liveness: Liveness = field(default_factory=Liveness)
    backends: tuple[str, ...] = ("UCX",)
    early_write: bool = True  # P: order the WRITE in the step that computes the prompt's last token (G10)
    progressive: bool = True  # P: WRITE each step's full blocks of a chunked prefill at its end (G14)

    def __post_init__(self) -> None:
        if self.progressive and not self.early_write:
            raise ValueError("progressive push needs early_write (its final WRITE is the completing step's)")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> Options:
        """Parse ``kv_connector_extra_config``; raise ``ValueError`` naming unknown keys or bad values."""
        extra = dict(extra or {})
        asked = set(extra)
        groups: dict[str, dict[str, float]] = {"timeouts": {}, "polling": {}, "liveness": {}}
        known: dict[str, str] = {}
        for group, kind in (("timeouts", Timeouts), ("polling", Polling), ("liveness", Liveness)):
            known.update({f.name: group for f in fields(kind)})
        backends = extra.pop("backends", ("UCX",))
        switches = {name: extra.pop(name, getattr(cls, name)) for name in _SWITCHES}
        if switches["early_write"] is False and "progressive" not in asked:
            switches["progressive"] = False  # its final WRITE is early_write's: off with it unless asked for
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config key(s) {unknown} for KvpushConnector; "
                f"known: {sorted([*known, 'backends', *_SWITCHES])}"
            )
        for name, value in switches.items():
            if not isinstance(value, bool):
                raise ValueError(f"bad kv_connector_extra_config for KvpushConnector: {name} must be true or false")
        try:
            for key, value in extra.items():
                groups[known[key]][key] = float(value)
            return cls(
                Timeouts(**groups["timeouts"]),
                Polling(**groups["polling"]),
                Liveness(**groups["liveness"]),
                tuple(str(b) for b in backends),
                switches["early_write"],
                switches["progressive"],
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad kv_connector_extra_config for KvpushConnector: {exc}") from exc


_SWITCHES = ("early_write", "progressive")  # boolean keys of kv_connector_extra_config
