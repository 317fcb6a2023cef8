"""What a transfer thread reports to the worker half (``TransferThread.collect_results``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from connector.transfer.base import RunShape


@dataclass(frozen=True)
class TransferRecord:
    """One completed WRITE, for statistics."""

    num_bytes: int
    seconds: float
    num_descriptors: int
    runs: RunShape = field(default_factory=RunShape)


@dataclass
class Results:
    """What the owner thread reported since the last ``collect_results``."""

    released: set[str] = field(default_factory=set)  # P: finished sending
    received: set[str] = field(default_factory=set)  # D: finished receiving (ok or not): blocks may be freed
    failed: set[str] = field(default_factory=set)  # D: without valid KV (reported now, freed with ``received``)
    records: list[TransferRecord] = field(default_factory=list)
    counters: Counter[str] = field(default_factory=Counter)

    def merge(self, other: Results) -> None:
        self.released |= other.released
        self.received |= other.received
        self.failed |= other.failed
        self.records += other.records
        self.counters.update(other.counters)

    def __bool__(self) -> bool:
        return bool(self.released or self.received or self.failed or self.records or self.counters)
