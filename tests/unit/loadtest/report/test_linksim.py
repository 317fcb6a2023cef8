"""The simulator against the link runs: per-point predictions on the fair-share and the FIFO link, the error per
preset, seeds for rows that did not record theirs, and the committed table rendered from committed data."""

from __future__ import annotations

import pytest

from loadtest.bench import linkrows
from loadtest.job import REPO
from loadtest.report import link, linksim
from loadtest.results import load_rows
from tests.unit.loadtest.report.test_link import headline, row


def test_the_simulator_table_predicts_every_kvpush_row() -> None:
    lines = linksim.table(linksim.points(headline(500.0), 256))
    assert len(lines) == 2 + 4  # header + one line per connector through kvpush
    assert lines[2].startswith("| ethernet-100g-like | 1024 | 1 | upstream-pull | 900.0 / ")
    assert link.chunk_of(headline(500.0)) == 256 and link.chunk_of([]) == 256


def test_rows_without_a_seed_get_the_suites_rule_and_a_recorded_seed_wins() -> None:
    rows = headline(500.0)
    rows[0]["qps_asked"], rows[1]["qps_asked"] = 1.0, 3.0
    rows[1]["qps"] = 3.0
    later = row("kvpush-push", 900.0, input_len=4096, created="2026-12-04T18:00:00", seed=77)
    seeds = linksim.arrival_seeds([*rows, later])
    assert seeds[id(rows[0])] == linkrows.point_seed(0, 0) and seeds[id(rows[1])] == linkrows.point_seed(0, 1)
    assert seeds[id(later)] == 77
    assert linksim.legacy_seed(3, 1) == linkrows.point_seed(3, 1)


def test_the_committed_sim_table_renders_from_committed_inputs_alone() -> None:
    """bench/README.md's sim table is a function of bench/results/summary.json: no git-ignored bench/runs."""
    rows = link.headline_run(load_rows(REPO / "bench/results/summary.json"))
    if not rows:
        pytest.skip("no link run committed")
    table = linksim.section(rows, link.chunk_of(rows))
    assert len(table) > 2
    readme = (REPO / "bench/README.md").read_text(encoding="utf-8").splitlines()
    start = readme.index(table[0])
    assert readme[start : start + len(table)] == table


def test_overlapping_transfers_hand_off_later_on_the_fair_share_link_than_one_at_a_time() -> None:
    # 25g-like: one prompt's KV takes ~4 prefills on the wire; at 1 QPS transfers overlap
    rows = [row(c, 1000.0, link="ethernet-25g-like", link_rate_bit_s=66_000_000, qps=1.0) for c in linksim.SIM_MODE]
    pts = linksim.points(rows, 256)
    assert [p.connector for p in pts] == list(linksim.SIM_MODE)
    push = next(p for p in pts if p.connector == "kvpush-push")
    assert push.fair[1] > push.fifo[1]


def test_the_error_per_preset_is_the_median_absolute_gap_under_each_model() -> None:
    def pt(preset: str, hand: float, fair: float, fifo: float) -> linksim.Comparison:
        return linksim.Comparison(1024, preset, 1.0, "kvpush-push", 100.0, hand, (100.0, fair), (100.0, fifo))

    pts = [pt("a", 150.0, 100.0, 50.0), pt("a", 90.0, 100.0, 100.0), pt("a", 100.0, 100.0, 100.0)]
    err = linksim.error_by_preset(pts)["a"]
    assert err["handoff fair"] == pytest.approx(0.1) and err["handoff fifo"] == pytest.approx(0.1)
    assert err["ttft fair"] == 0.0
    lines = linksim.error_table(pts)
    assert lines[2] == "| a | 3 | 10 % | 10 % | 0 % | 0 % |"
    assert linksim.gap(None, 1.0) is None and linksim.gap(2.0, 1.0) == 1.0


def test_connectors_the_simulator_does_not_model_are_left_out_of_its_table() -> None:
    # the link run 20261205T180649Z died rendering: 'kvpush-layer' is not in SIM_MODE
    rows = [*headline(500.0), row("kvpush-layer", 400.0), row("kvpush-layer-chunked", 400.0)]
    modelled = [p.connector for p in linksim.points(headline(500.0), 256)]
    assert [p.connector for p in linksim.points(rows, 256)] == modelled
