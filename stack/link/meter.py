"""The honesty check of a run on the link: did the KV really cross P's NIC?

UCX calls two processes of one kernel "intra-node" and, unless told `UCX_TLS=tcp`, WRITEs with cma
(process_vm_writev) straight into the peer's memory: the link then carries a few KB for hundreds of MB of KV
and the emulation silently measures loopback memcpy (research turn3-netem.md 4.1). A `NicMeter` reads the
bytes that left one engine's NIC since it was made; `check(kv_bytes)` compares them with the KV bytes D says
it received (`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` x KV bytes per token) and the
shapers' drop counter (0 expected: drops are an artefact of a too-small queue).

    meter = NicMeter(link, "b-p0")
    ...                                          # the requests of one row
    result = meter.check(kv_bytes)               # result.ok, result.record() into the row
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from stack.link.plan import bytes_verdict

__all__ = ["BytesCheck", "NicMeter"]


class _NicCounters(Protocol):
    def nic_bytes(self, name: str) -> Any: ...

    def drops(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class BytesCheck:
    """One window's verdict: the bytes P sent onto the link against the KV bytes transferred."""

    engine: str
    crossed_bytes: int
    kv_bytes: int
    drops: int
    verdict: str | None  # None: the KV crossed the link; else why the row must fail

    @property
    def ok(self) -> bool:
        return self.verdict is None

    def record(self) -> dict[str, Any]:
        return {
            "link_nic": self.engine,
            "link_nic_tx_bytes": self.crossed_bytes,
            "link_kv_bytes": self.kv_bytes,
            "link_drops": self.drops,
            "link_bytes_ok": self.ok,
            "link_bytes_verdict": self.verdict,
        }


class NicMeter:
    """Counts the bytes that leave engine `engine`'s NIC from now on (and the link's drops)."""

    def __init__(self, link: _NicCounters, engine: str) -> None:
        self._link = link
        self.engine = engine
        self._tx0 = int(link.nic_bytes(engine).tx)
        self._drops0 = link.drops()

    def crossed(self) -> int:
        return int(self._link.nic_bytes(self.engine).tx) - self._tx0

    def check(self, kv_bytes: int) -> BytesCheck:
        """The verdict for this window: at least `kv_bytes` must have left the NIC."""
        crossed = self.crossed()
        return BytesCheck(
            self.engine, crossed, kv_bytes, self._link.drops() - self._drops0, bytes_verdict(crossed, kv_bytes)
        )
