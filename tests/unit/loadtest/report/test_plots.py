import json
from pathlib import Path
from typing import Any

from loadtest.records import ClientRecord, write_jsonl
from loadtest.report.plots import suite_plots


def row(mode: str, qps: float, records: Path) -> dict[str, Any]:
    dist = {"mean": 10.0 * qps, "p50": 9.0 * qps, "p90": 12.0, "p99": 20.0 * qps}
    return {
        "suite": "seed-sim",
        "router": "kvpush",
        "mode": mode,
        "qps": qps,
        "concurrency": None,
        "ttft_ms": dist,
        "tpot_ms": dist,
        "handoff_ms": dist,
        "e2e_ms": dist,
        "records": str(records),
    }


def test_seed_plots_are_written(tmp_path: Path) -> None:
    recs = tmp_path / "requests.jsonl"
    write_jsonl(recs, [ClientRecord(i, str(i), ok=True, ttft_s=0.01 * (i + 1), handoff_ms=2.0 + i) for i in range(5)])
    rows = [row(m, q, recs) for m in ("push", "pull") for q in (1.0, 2.0)]
    files = suite_plots("seed-sim", rows, tmp_path)
    assert [f.name for f in files] == ["seed-sim.png", "seed-sim-ttft-cdf.png", "seed-sim-handoff-cdf.png"]
    for f in files:
        assert f.read_bytes()[:4] == b"\x89PNG"
    json.dumps(rows)  # rows stay plain JSON


def test_the_link_suite_draws_bars_per_preset_and_a_ttft_cdf(tmp_path: Path) -> None:
    recs = tmp_path / "requests.jsonl"
    write_jsonl(recs, [ClientRecord(i, str(i), ok=True, ttft_s=0.1 * (i + 1)) for i in range(5)])
    rows = []
    for conn, router in (
        ("upstream-pull", "kvpush"),
        ("kvpush-progressive", "kvpush"),
        ("upstream-push", "vllm-router"),
    ):
        r = row("push", 1.0, recs)
        r.update(suite="link", connector=conn, router=router, link="ethernet-100g-like", input_len=1024)
        rows.append(r)
    files = suite_plots("link", rows, tmp_path)
    assert [f.name for f in files] == ["link.png", "link-ttft-cdf.png"]
    assert all(f.stat().st_size > 0 for f in files)
