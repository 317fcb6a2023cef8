import datetime as dt
import json
from pathlib import Path

import pytest

from loadtest import machine
from loadtest.records import ClientRecord
from loadtest.results import REQUIRED, RowLabels, append_rows, build_row, load_rows
from loadtest.stats import summarize


def labels(**kw: object) -> RowLabels:
    base: dict[str, object] = dict(
        suite="seed-sim",
        router="kvpush",
        mode="push",
        connector="sim",
        qps=2.0,
        concurrency=None,
        input_len=16,
        output_len=4,
    )
    base.update(kw)
    return RowLabels(**base)  # type: ignore[arg-type]


def test_row_has_every_required_field_and_is_valid_json(tmp_path: Path) -> None:
    recs = [ClientRecord(0, "a", ok=True, ttft_s=0.1, e2e_s=0.4, output_tokens=4, handoff_ms=12.0)]
    row = build_row(
        summarize(recs, 1.0), labels(extra={"profile": "zero"}), "abc", now=dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    )
    assert set(REQUIRED) <= set(row)
    assert row["handoff_ms"]["p50"] == 12.0 and row["profile"] == "zero"
    assert row["created"] == "2026-01-01T00:00:00+00:00" and row["git_commit"] == "abc"
    assert row["machine"] == machine.describe() and " cores, " in row["machine"]  # where it ran, for bench/README
    path = tmp_path / "summary.json"
    append_rows(path, [row])
    append_rows(path, [row])
    assert len(json.loads(path.read_text())) == 2 and len(load_rows(path)) == 2


def test_empty_run_turns_nan_into_null() -> None:
    row = build_row(summarize([ClientRecord(0, "a", error="x")], 0.0), labels(qps=float("inf")), "c")
    assert row["failed"] == 1 and row["ttft_ms"] is None and row["req_per_s"] is None and row["qps"] is None
    json.dumps(row, allow_nan=False)


def test_labels_are_checked() -> None:
    with pytest.raises(ValueError):
        labels(router="nginx")
