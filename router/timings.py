"""Per-request router timings (the KV handoff among them), kept in a bounded ring for GET /debug/timings."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class RequestRecord:
    """One client request as the router saw it. Times are the router's monotonic clock, in seconds."""

    request_id: str
    endpoint: str
    mode: str
    stream: bool
    t_start: float
    pairing_id: str | None = None
    transfer_id: str | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    outcome: str = "pending"
    attempts: int = 0
    prefill_sent: float | None = None
    prefill_done: float | None = None
    decode_sent: float | None = None
    decode_first_byte: float | None = None
    t_end: float | None = None

    def new_attempt(self) -> None:
        self.attempts += 1
        self.prefill_sent = self.prefill_done = self.decode_sent = self.decode_first_byte = None

    @property
    def ttft(self) -> float | None:
        return _span(self.t_start, self.decode_first_byte)

    @property
    def handoff(self) -> float | None:
        """Prefill leg done → decode's first byte: the KV handoff as the router sees it."""
        return _span(self.prefill_done, self.decode_first_byte)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ttft_ms"] = _ms(self.ttft)
        out["handoff_ms"] = _ms(self.handoff)
        out["decode_wait_ms"] = _ms(_span(self.decode_sent, self.decode_first_byte))
        return out


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


class TimingLog:
    """The most recent `capacity` records, oldest dropped first."""

    def __init__(self, capacity: int) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=capacity)

    def add(self, record: RequestRecord) -> None:
        if self._records.maxlen:
            self._records.append(record)

    def query(self, *, request_id: str | None = None, pairing_id: str | None = None) -> list[dict[str, Any]]:
        return [
            r.to_json()
            for r in self._records
            if (request_id is None or r.request_id == request_id) and (pairing_id is None or r.pairing_id == pairing_id)
        ]
