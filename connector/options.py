"""``kv_connector_extra_config``: every option of the connector, parsed and checked at engine start.

``Options.from_extra`` refuses unknown keys (naming the known ones) and bad values (G9).

The progress model (``progress``): who moves UCX's bytes and notices (over TCP a WRITE is a byte stream
the *target* must progress too, not one-sided as on RDMA):

* ``"auto"`` (default): ``"poll"`` when the side channel listens on a loopback address (every peer is on this
  machine), else ``"thread"``: the thread moved KV at the link's pace a little sooner on a link and cost
  CPU on a loaded two-core loopback box (connector/README.md, "Defaults decided by measurement").
* ``"poll"``: no NIXL progress thread; the owner thread progresses UCX when it polls, on a
  timer that runs only while something is in flight on this side (P: a WRITE posted; D: a registration
  waiting for its KV, or an order waiting for its ``ReadyEvent``), 0.2 ms doubling to
  ``write_poll_max_s``; idle, it sleeps (``idle_wait_s`` safety net). Costs up to one poll interval per
  transfer; no busy core.
* ``"thread"``: NIXL's UCX progress thread, made event-driven: it sleeps in ``poll()`` on UCX's event fd
  for at most ``progress_delay_us`` (NIXL's Python API would spin: its delay is hard-coded to 0, about
  a core per agent), so bytes move at the link's speed whatever the owner thread does (about 2 % of a
  core idle, research turn3-netem 4.3); the owner thread still reads notices on the same timer.

When P's WRITEs leave (``push_granularity``): ``"layer"`` (default), one part per run of layers whose KV is in
the cache, while the forward still computes the later layers (``connector.transfer.layered``); ``"step"``, a
step's blocks in one WRITE once the step's forward is over. Layer-wise is the default since it won on a link
and tied on loopback (connector/README.md, "Defaults decided by measurement"); a layer vLLM never reports
(a full CUDA graph replay) is written at the step's end, as with ``"step"``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from connector.rendezvous.actions import Timeouts
from connector.wire.side_channel import Liveness


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
    progress: str = "auto"  # "auto" | "poll" | "thread": who progresses UCX (module docstring)
    progress_delay_us: int = 1000  # "thread": the progress thread's longest sleep in poll()
    push_granularity: str = "layer"  # P: "layer" | "step": WRITE layer by layer as computed, or a step's at its end

    def __post_init__(self) -> None:
        if self.progressive and not self.early_write:
            raise ValueError("progressive push needs early_write (its final WRITE is the completing step's)")
        if self.progress not in PROGRESS_MODELS:
            raise ValueError(f"progress must be one of {list(PROGRESS_MODELS)}, not {self.progress!r}")
        if self.push_granularity not in GRANULARITIES:
            raise ValueError(f"push_granularity must be one of {list(GRANULARITIES)}, not {self.push_granularity!r}")
        if self.progress_delay_us < 1:
            raise ValueError("progress_delay_us must be >= 1 (0 makes NIXL's progress thread spin)")

    def progress_model(self, side_host: str) -> str:
        """``"poll"`` or ``"thread"``: ``progress`` with ``"auto"`` decided by the side channel's address."""
        if self.progress != "auto":
            return self.progress
        return "poll" if is_loopback(side_host) else "thread"

    def progress_thread_delay_us(self, side_host: str) -> int | None:
        """The NIXL progress thread's poll() timeout, or None: no progress thread (``"poll"``)."""
        return self.progress_delay_us if self.progress_model(side_host) == "thread" else None

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
        progress = extra.pop("progress", cls.progress)
        delay = extra.pop("progress_delay_us", cls.progress_delay_us)
        granularity = extra.pop("push_granularity", cls.push_granularity)
        switches = {name: extra.pop(name, getattr(cls, name)) for name in _SWITCHES}
        if switches["early_write"] is False and "progressive" not in asked:
            switches["progressive"] = False  # its final WRITE is early_write's: off with it unless asked for
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config key(s) {unknown} for KvpushConnector; "
                f"known: {sorted([*known, *_VALUES, *_SWITCHES])}"
            )
        for name, value in switches.items():
            if not isinstance(value, bool):
                raise ValueError(f"bad kv_connector_extra_config for KvpushConnector: {name} must be true or false")
        try:
            for key, value in extra.items():
                groups[known[key]][key] = float(value)
            return cls(
                Timeouts.derived(**groups["timeouts"]),
                Polling(**groups["polling"]),
                Liveness(**groups["liveness"]),
                tuple(str(b) for b in backends),
                switches["early_write"],
                switches["progressive"],
                str(progress),
                int(delay),
                str(granularity),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad kv_connector_extra_config for KvpushConnector: {exc}") from exc


_SWITCHES = ("early_write", "progressive")  # boolean keys of kv_connector_extra_config
_VALUES = ("backends", "progress", "progress_delay_us", "push_granularity")  # the other keys outside the groups
PROGRESS_MODELS = ("auto", "poll", "thread")
GRANULARITIES = ("step", "layer")  # push_granularity: after the step, or per layer (transfer/layered.py)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine's loopback: every peer of such a side channel is local."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: a reachable interface
        return False
