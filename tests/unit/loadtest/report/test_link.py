"""The link suite's section: per-step tables with the link's figures, the bytes check failing a row, the targets
judged on medians (and paired per repeat), efa-like against the loopback spread, multi-turn not run, the sim."""

from __future__ import annotations

from typing import Any

from loadtest.report import link


def row(conn: str, ttft: float, *, router: str = "kvpush", qps: float = 1.0, rep: int = 0, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "suite": "link",
        "run_id": "r1",
        "router": router,
        "mode": "pull" if conn == "upstream-pull" else "push",
        "connector": conn,
        "qps": qps,
        "input_len": 1024,
        "output_len": 64,
        "n": 8,
        "failed": 0,
        "ttft_ms": {"mean": ttft, "p50": ttft},
        "tpot_ms": {"mean": 9.0},
        "handoff_ms": {"p50": ttft - 300},
        "created": f"2026-12-04T17:{rep:02d}:00",
        "repeat": rep,
        "headline": True,
        "link": "ethernet-100g-like",
        "link_rate_bit_s": 120_000_000,
        "link_prefill_s": 0.3,
        "link_prefill_times_s": [0.29, 0.3, 0.31],
        "link_expected_transfer_s": 0.292,
        "link_prompt_kv_bytes": 4 * 2**20,
        "link_faithful": True,
        "link_nic_tx_bytes": 9 * 4 * 2**20,
        "link_kv_bytes": 9 * 4 * 2**20 - 100,
        "link_bytes_ok": True,
        "xfer_ms_mean": 290.0,
        "kv_external_frac": 1.0,
        "outputs_equal_single": [2, 2],
        "chunk_tokens": 256,
    }
    base.update(kw)
    return base


def headline(prog: float) -> list[dict[str, Any]]:
    out = []
    for rep in range(3):
        out += [row("upstream-pull", 900.0, rep=rep), row("upstream-push", 1000.0, rep=rep)]
        out += [row("kvpush-push", 850.0, rep=rep), row("kvpush-progressive", prog + rep, rep=rep)]
    return out


def test_a_step_table_shows_rate_prefill_transfer_and_the_bytes_check() -> None:
    text = "\n".join(link.section(headline(500.0), [], []))
    assert "ethernet-100g-like, 1024-token prompts**: tbf 120.0 Mbit/s" in text
    assert "measured prefill 300 ms (runs: 290, 300, 310 ms)" in text
    assert "| 1 | kvpush | kvpush-progressive | 3 | 24 | 0 | 501.0 (500.0-502.0) |" in text
    assert "| 290.0 (290.0-290.0) | 1.000 (1.000-1.000) | 3/3 ok | 100 (100-100) | 2/2 |" in text
    assert "all clean" in text


def test_the_targets_are_judged_on_the_medians_and_paired_per_repeat() -> None:
    verdicts = link.headline_verdicts(headline(500.0))
    assert [(v.target, v.met) for v in verdicts] == [
        ("ours (product default) TTFT mean <= 0.6x pull", False),
        ("ours (product default) TTFT mean <= 0.8x upstream push", False),
        ("ours (product default) TPOT mean <= pull", True),
        ("progressive TTFT mean <= 0.6x pull", True),
        ("progressive TTFT mean <= 0.8x upstream push", True),
        ("progressive TPOT mean <= pull", True),
    ]
    missed = link.headline_verdicts(headline(600.0))
    assert missed[3].met is False and missed[3].limit == 540.0
    assert link.paired_ratios(headline(450.0), "kvpush-progressive", "upstream-pull") == [0.5, 451 / 900, 452 / 900]


def test_a_row_whose_kv_bypassed_the_link_is_not_clean() -> None:
    bad = row("kvpush-push", 800.0, link_nic_tx_bytes=4000, link_bytes_ok=False)
    assert not link.row_ok(bad) and link.row_ok(row("kvpush-push", 800.0))
    assert not link.row_ok(row("kvpush-push", 800.0, kv_external_frac=0.5))
    assert not link.row_ok(row("kvpush-push", 800.0, outputs_equal_single=[1, 2]))
    text = "\n".join(link.section([*headline(500.0), bad], [], []))
    assert "**1 not clean**" in text and "0/1 ok" not in text  # grouped with its front's other rows
    ratio = link.bytes_ratio(bad)
    assert ratio is not None and ratio < 1


def test_efa_rows_are_held_against_the_loopback_runs_worst_repeat() -> None:
    efa = [row("kvpush-push", 170.0, link="efa-like"), row("upstream-pull", 200.0, link="efa-like")]
    loop = [row("kvpush-push", t, rep=i, suite="cpu-vllm") for i, t in enumerate((150.0, 160.0, 175.0))]
    verdicts = {v.point: v for v in link.efa_verdicts(efa, loop)}
    assert verdicts["kvpush/kvpush-push, 1024 tokens, 1 QPS"].met is True
    assert verdicts["kvpush/kvpush-push, 1024 tokens, 1 QPS"].limit == 175.0
    assert verdicts["kvpush/upstream-pull, 1024 tokens, 1 QPS"].met is None  # no loopback row: not judged


def test_multiturn_on_the_link_is_marked_not_run_without_rows() -> None:
    text = "\n".join(link.section(headline(500.0), [], []))
    assert "Multi-turn on ethernet-25g-like: not run" in text


def test_no_rows_no_tables() -> None:
    assert link.section([], [], []) == ["(no link run yet: `kvpush bench --suite link`, as root)"]


def test_the_multiturn_part_names_its_run_rate_bytes_check_and_decider_options() -> None:
    mt = [
        {
            "run_id": "m1",
            "front": front,
            "repeat": 0,
            "link": "ethernet-25g-like",
            "link_rate_bit_s": 59_800_000,
            "link_bytes_ok": True,
            "plan": {"decider_options": [["bypass_max_uncached_tokens", 1024]], "sessions": 6},
            "ttft_ms_turn2plus": {"p50": p50},
        }
        for front, p50 in (("kvpush", 400.0), ("kvpush-decider", 120.0), ("vllm-router", 380.0))
    ]
    text = "\n".join(link.multiturn_part(mt, False))
    assert "Run m1: preset ethernet-25g-like, tbf 59.8 Mbit/s; bytes check 3/3 rows ok" in text
    assert "{'bypass_max_uncached_tokens': 1024}" in text
    assert "decider / vllm-router: 0.32" in text


def test_the_wire_table_shows_ours_against_bare_nixl_per_preset_and_says_when_not_run() -> None:
    wire = [
        {
            "suite": "link-wire",
            "run_id": "w1",
            "input_len": 1024,
            "link": "ethernet-25g-like",
            "link_rate_bit_s": 60_000_000,
            "link_expected_transfer_s": 0.585,
            "link_prompt_kv_bytes": 4 * 2**20,
            "link_kv_bytes": 20 * 2**20,
            "link_nic_tx_bytes": 21 * 2**20,
            "wire_connector_times_ms": [590.0] * 5,
            "wire_connector_ms": 590.0,
            "wire_bare_ms": 585.0,
            "wire_ratio": 1.0085,
            "wire_limit_ms": 643.5,
            "wire_ok": True,
        },
        {"link": "efa-like", "wire_connector_ms": 9.0, "wire_bare_ms": 5.0, "wire_ok": False, "wire_limit_ms": 7.0},
    ]
    lines = link.wire_part(wire)
    assert lines[0].startswith("Run w1: one 1024-token prompt's KV (4 MiB")
    assert lines[4] == "| ethernet-25g-like | 60.0 | 585.0 | 590.0 | 585.0 | 1.008 | met | 1.050 |"
    assert "**missed** (limit 7.0 ms)" in lines[5]
    assert "Not run" in link.wire_part([])[0]
    assert "### Our connector at wire speed (issue 21 item 3)" in link.section(headline(500.0), [], [], wire=wire)


def test_steps_the_latest_run_did_not_measure_come_from_the_newest_earlier_run_that_did() -> None:
    latest = headline(500.0)
    old_same = [row("upstream-pull", 1.0, run_id="r0")]
    old_efa = [row("upstream-pull", 777.0, run_id="r0", link="efa-like")]
    older_efa = [row("upstream-pull", 555.0, run_id="q9", link="efa-like")]
    older_4k = [row("upstream-pull", 666.0, run_id="q9", input_len=4096)]
    text = "\n".join(link.earlier_part(latest, [*old_same, *old_efa, *older_efa, *older_4k]))
    assert "Run r0 (earlier):" in text and "efa-like, 1024-token prompts" in text and "777.0" in text
    assert "Run q9 (earlier):" in text and "ethernet-100g-like, 4096-token prompts" in text and "666.0" in text
    assert "555.0" not in text  # efa-like 1024 already shown from the newer run r0
    assert "| 1.0 |" not in text and " 1.0 (" not in text  # the latest run's own step is not repeated
    assert link.earlier_part(latest, old_same) == []


def test_a_deeper_models_run_names_its_model_and_keeps_the_bench_models_step_of_the_same_preset() -> None:
    deep = [{**r, "run_id": "r2", "model": "bench-deep"} for r in headline(300.0)]
    text = "\n".join(link.section(deep, [], []))
    assert "**ethernet-100g-like, 1024-token prompts, model `bench-deep`**: tbf" in text
    older_bench = headline(500.0)  # run r1, no `model` field: the bench model
    earlier = "\n".join(link.earlier_part(deep, older_bench))
    assert "Run r1 (earlier):" in earlier and "**ethernet-100g-like, 1024-token prompts**: tbf" in earlier
    assert "501.0 (500.0-502.0)" in earlier


def test_the_efa_check_judges_the_newest_efa_rows_of_the_bench_model_also_from_an_earlier_run() -> None:
    loopback = [{**row("upstream-pull", 150.0, rep=k), "suite": "cpu-vllm", "run_id": "L"} for k in range(3)]
    old_efa = [row("upstream-pull", 140.0, run_id="r0", link="efa-like", headline=False)]
    deep_efa = [row("upstream-pull", 999.0, run_id="r2", link="efa-like", headline=False, model="bench-deep")]
    text = "\n".join(link.section(headline(500.0), loopback, [], earlier=[*old_efa, *deep_efa]))
    assert "efa-like (run r0) against the loopback cpu-vllm run L" in text
    assert "| kvpush/upstream-pull, 1024 tokens, 1 QPS | 140.00 | 150.00 | 150.00 |" in text
    assert "999" not in text.split("efa-like (run r0)")[1].split("###")[0]


def test_the_section_leads_with_the_newest_bench_model_run_and_shows_a_later_deeper_run_after_it() -> None:
    bench = headline(500.0)  # run r1, bench model
    deep = [{**r, "run_id": "r2", "model": "bench-deep"} for r in headline(300.0)]
    assert link.headline_run([*bench, *deep]) == bench
    assert link.headline_run([*deep, *bench]) == bench
    assert link.headline_run(deep) == deep  # no bench-model run at all: the newest one
    efa_only = [{**r, "run_id": "r3", "link": "efa-like", "headline": True} for r in headline(140.0)]
    assert link.headline_run([*bench, *efa_only]) == bench  # a later rerun of another preset does not lead
    assert link.headline_run(efa_only) == efa_only
    assert "Run r3 (later, other presets):" in "\n".join(link.earlier_part(bench, efa_only))
    text = "\n".join(link.earlier_part(bench, deep))
    assert "Run r2 (later, another model):" in text and "model `bench-deep`" in text


def test_the_efa_check_also_judges_against_the_same_runs_unshaped_step() -> None:
    loopback = [{**row("upstream-pull", 100.0, rep=k), "suite": "cpu-vllm", "run_id": "L"} for k in range(3)]
    efa = [row("upstream-pull", t, rep=k, run_id="r5", link="efa-like") for k, t in enumerate((205.0, 210.0, 215.0))]
    unshaped = [row("upstream-pull", t, rep=k, run_id="r5", link="unshaped") for k, t in enumerate((200.0, 212.0))]
    other_run = [row("upstream-pull", 900.0, run_id="r4", link="unshaped")]
    assert link.in_run_control(efa, [*efa, *unshaped, *other_run]) == unshaped
    [in_run] = link.efa_verdicts(efa, unshaped, "same run")
    [across_runs] = link.efa_verdicts(efa, loopback)
    assert in_run.met is True and across_runs.met is False  # a slower run is not read as the link's artefact
    text = "\n".join(link.section(headline(500.0), loopback, [], earlier=[*efa, *unshaped, *other_run]))
    same_run = text.split("efa-like against the unshaped step of the same run (r5)")[1].split("efa-like (run r5)")[0]
    assert "| kvpush/upstream-pull, 1024 tokens, 1 QPS | 210.00 | 206.00 | 212.00 |" in same_run  # met
    across = text.split("efa-like (run r5) against the loopback cpu-vllm run L")[1].split("###")[0]
    assert "| kvpush/upstream-pull, 1024 tokens, 1 QPS | 210.00 | 100.00 | 100.00 |" in across  # missed


def test_without_an_unshaped_step_only_the_loopback_check_is_shown() -> None:
    efa = [row("upstream-pull", 140.0, run_id="r0", link="efa-like", headline=False)]
    assert link.in_run_control(efa, efa) == [] and link.in_run_control([], efa) == []
    text = "\n".join(link.section(headline(500.0), [], [], earlier=efa))
    assert "unshaped step of the same run" not in text and "efa-like (run r0) against the loopback" in text


def test_an_old_runs_layer_chunked_rows_still_render_labelled_and_judged() -> None:
    """The layer-chunked front was deleted (bench/ANALYSIS.md); runs before it still carry its rows."""
    old = [row("kvpush-layer-chunked", 480.0 + rep, rep=rep) for rep in range(3)]
    text = "\n".join(link.section([*headline(500.0), *old], [], []))
    assert "| 1 | kvpush | kvpush-layer-chunked | 3 | 24 | 0 | 481.0 (480.0-482.0) |" in text
    assert "all clean" in text
    targets = {v.target for v in link.headline_verdicts([*headline(500.0), *old])}
    assert "layer-wise chunked TTFT mean <= 0.6x pull" in targets
