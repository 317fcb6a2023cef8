"""One request's outcome as the client saw it (plus the router's own timings), and its JSONL form."""

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ClientRecord:
    """Times are seconds on the client's clock; `sent` is relative to the start of the run.

    ttft_s: first SSE chunk carrying a choice (as `vllm bench serve`); ttft_text_s: first chunk with non-empty
    text; e2e_s: last chunk carrying a choice; itl_s: gaps between consecutive choice chunks.
    output_tokens comes from the usage chunk (None if the server sent none).
    """

    index: int
    request_id: str
    sent: float = 0.0
    ok: bool = False
    error: str | None = None
    status: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None
    ttft_text_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0
    pairing_id: str | None = None
    handoff_ms: float | None = None
    router_ttft_ms: float | None = None
    decode_wait_ms: float | None = None

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1), None when undefined (failed, or a single output token)."""
        if not self.ok or self.e2e_s is None or self.ttft_s is None:
            return None
        if self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tpot_s"] = self.tpot_s
        return out


def write_jsonl(path: Path, records: Iterable[ClientRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec.to_json(), separators=(",", ":")) + "\n")


def read_jsonl(path: Path) -> list[ClientRecord]:
    out: list[ClientRecord] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            raw = json.loads(line)
            raw.pop("tpot_s", None)
            out.append(ClientRecord(**raw))
    return out
