"""The replicas run's subsection of bench/README.md: the fronts' table and issue 24's targets, met or not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtest.report import multiturn_replicas as report
from loadtest.report.readme import latest_per_replicas, multiturn_section


def row(front: str, repeat: int, hits: float, cpu: float, **more: Any) -> dict[str, Any]:
    return {
        "run_id": "R1",
        "front": front,
        "repeat": repeat,
        "replicas": 2 if front == report.REPLICAS else 1,
        "turns_ok": 10,
        "turns_failed": 0,
        "local_hit_frac_of_ideal": hits,
        "router_cpu_ms_per_turn": cpu,
        **more,
    }


KV = {"events_per_s_per_replica": 40.0, "messages_per_s_per_replica": 12.0, "lag_ms_mean": 1.5}


def test_the_targets_are_judged_within_each_repeat() -> None:
    rows = [
        row(report.EVENTS, 0, 0.90, 4.0, bypass_accuracy={"checked": 10, "accurate": 10}, kv_events=KV),
        row(
            report.REPLICAS,
            0,
            0.88,
            4.2,
            bypass_accuracy={"checked": 10, "accurate": 9},
            reset_reflected={"total_s": 0.05, "reset_and_step_s": 0.04},
        ),
        row(report.EVENTS_OFF, 0, 0.90, 3.8, bypass_accuracy={"checked": 10, "accurate": 10}),
    ]
    lines = report.targets(rows)
    assert lines[0].endswith("0.98 (per repeat: 0.98; target >= 0.9: met)")
    assert "kvpush-decider-replicas: 9/10 (90%)" in lines[2] and lines[2].endswith(": met)")
    assert lines[3].startswith("- router CPU per turn") and "1.05" in lines[3] and lines[3].endswith(": met)")
    assert "40.0 events/s" in lines[4] and "reflected in every replica's view: not measured" in lines[4]
    assert "50 ms after the reset asked" in lines[5] and lines[5].endswith("in 40 ms; target <= 1 s: met)")
    stopped = {"stop_s": 2.1, "held_blocks_before": [30, 30], "after_exit_s": 0.004}
    last = report.targets([*rows, row(report.REPLICAS, 1, 0.9, 4.0, engine_stop_reflected=stopped)])[-1]
    assert "held [30, 30] blocks" in last and last.endswith("empty 4 ms after its exit (target <= 1 s: met)")
    late = report.targets([row(report.REPLICAS, 1, 0.9, 4.0, engine_stop_reflected={"after_exit_s": None})])[-1]
    assert late.endswith("not within 10 s after its exit (target <= 1 s: not met)")


def test_a_target_missed_or_not_run_says_so() -> None:
    rows = [row(report.EVENTS, 0, 0.9, 2.0), row(report.REPLICAS, 0, 0.5, 2.0), row(report.EVENTS_OFF, 0, 0.9, 1.0)]
    lines = report.targets(rows)
    assert lines[0].endswith(": not met)") and lines[3].endswith("target <= 1.1: not met)")
    assert report.targets([row(report.EVENTS, 0, 0.9, 2.0)])[0].endswith("not measured (target >= 0.9)")


def test_the_subsection_follows_the_multiturn_table_and_stands_alone_too() -> None:
    replicas = [row(report.EVENTS, 0, 0.9, 2.0), row(report.REPLICAS, 0, 0.9, 2.0)]
    alone = multiturn_section([], None, replicas)
    assert alone[0] == "## multiturn" and alone[2].startswith("### multiturn, 2 router replicas")
    assert multiturn_section([], None, []) == []
    both = multiturn_section([row("kvpush", 0, 0.8, 1.0)], None, replicas)
    assert both.count("## multiturn") == 1 and any(line.startswith("### multiturn, 2 router") for line in both)


def test_the_newest_run_of_each_replica_count_gets_its_own_subsection() -> None:
    def run(rid: str, count: int) -> list[dict[str, Any]]:
        rows = [row(report.EVENTS, 0, 0.9, 2.0), {**row(report.REPLICAS, 0, 0.9, 2.0), "replicas": count}]
        return [{**r, "run_id": rid, "suite": "multiturn-replicas"} for r in rows]

    rows = [*run("R1", 2), *run("R2", 3), *run("R3", 2), {"suite": "multiturn", "run_id": "R9"}]
    picked = latest_per_replicas(rows)
    assert sorted({r["run_id"] for r in picked}) == ["R2", "R3"]
    heads = [line for line in multiturn_section([], None, picked) if line.startswith("###")]
    assert heads == [
        "### multiturn, 2 router replicas sharing the engines' KV events",
        "### multiturn, 3 router replicas sharing the engines' KV events",
    ]


def test_the_subscribers_capacity_is_shown_when_measured(tmp_path: Path) -> None:
    assert report.capacity(tmp_path / "kv-events-rate.json") == [] and report.capacity(None) == []
    rate = {"rate_asked": 5000.0, "events_per_s": 9999.7, "blocks_per_s": 40000.0, "gaps": 0, "lag_ms_mean": 8.1}
    data = {"run_id": "R2", "loadavg": 4.7, "rows": [{**rate, "blocks_per_message": 8, "lag_ms_max": 31.4}]}
    (tmp_path / "kv-events-rate.json").write_text(json.dumps(data), encoding="utf-8")
    lines = report.capacity(tmp_path / "kv-events-rate.json")
    assert "run R2" in lines[1] and lines[-1].startswith("| 5000 | 9999.7 | 40000.0 | 0 | 8.1 / 31.4 |")


def test_the_subsection_says_how_to_run_it_again() -> None:
    plan = {"replicas": 2, "sessions": 8, "session_rate": 0.4, "repeats": 2, "seed": 11}
    lines = report.section([{**row(report.EVENTS, 0, 0.9, 2.0), "plan": plan}])
    assert lines[-1] == (
        "Reproduce: `flock /tmp/kvpush-vllm.lock kvpush bench --suite multiturn --set replicas=2 --set sessions=8"
        " --set session_rate=0.4 --set repeats=2`."
    )


def test_the_subsection_says_whether_the_deciders_had_the_tokenizer() -> None:
    before = report.section([row(report.EVENTS, 0, 0.9, 2.0)])
    after = report.section([{**row(report.EVENTS, 0, 0.9, 2.0), "answer_tokenizer": True}])
    assert not any("option `tokenizer`" in line for line in before)
    assert any("option `tokenizer`" in line for line in after)


def over(events: str, conc: int, repeat: int, cpu: float) -> dict[str, Any]:
    return {"router": "kvpush", "mode": "push", "run_id": "O1", "kv_events": events, "concurrency": conc} | {
        "repeat": repeat,
        "cpu_s_per_1k": cpu,
    }


def test_the_overhead_suites_events_on_off_cpu_is_paired_by_repeat() -> None:
    rows = [over("off", 64, 0, 1.0), over("on", 64, 0, 1.04), over("off", 64, 1, 1.0), over("on", 64, 1, 1.2)]
    rows.append({"router": "kvpush", "mode": "pull", "concurrency": 64, "repeat": 0, "cpu_s_per_1k": 9.0})
    lines = report.overhead_cpu(rows)
    assert "run O1" in lines[1] and lines[-1] == "- concurrency 64: 1.12 (per repeat: 1.04, 1.20; not met)"
    assert report.overhead_cpu([over("off", 1, 0, 1.0)]) == []


def routes(turns: int, bypass: int, first: int = 2, first_bypass: int = 0) -> dict[str, int]:
    return {"turns": turns, "bypass": bypass, "first_turns": first, "first_bypass": first_bypass}


def test_issue_40_judges_each_replicas_bypass_rate_against_one_routers_and_the_predictions() -> None:
    exact = {"checked": 9, "accurate": 9, "predicted_cached": 900, "actual_cached": 900}
    one = row(report.EVENTS, 0, 0.9, 2.0, bypass_by_replica=[routes(12, 9)], bypass_accuracy=exact)
    off = {**exact, "actual_cached": 880}
    many = row(report.REPLICAS, 0, 0.9, 2.0, bypass_by_replica=[routes(6, 5, 1, 1), routes(6, 4)], bypass_accuracy=off)
    lines = report.exact_lines([one, many])
    assert lines[0].startswith(
        "- repeat 0: bypassed turns per replica 5 of 6 (first turns 1 of 1, later 4 of 5), 4 of 6 (first turns 0 of 2,"
        " later 4 of 4) against one router's 9 of 12 (first turns 0 of 2, later 9 of 10):"
    )
    assert "lowest 0.89x (target >= 0.95: not met), spread 16.7 points (target <= 5: not met)" in lines[0]
    assert "predicted 900 cached tokens, decode reported 900 (equal;" in lines[1]
    assert "decode reported 880 (differ by +20;" in lines[2]
    even = row(report.REPLICAS, 0, 0.9, 2.0, bypass_by_replica=[routes(6, 5), routes(6, 5)], bypass_accuracy=exact)
    good = report.exact_lines([row(report.EVENTS, 0, 0.9, 2.0, bypass_by_replica=[routes(12, 10)]), even])
    assert "lowest 1.00x (target >= 0.95: met), spread 0.0 points (target <= 5: met)" in good[0]
    assert good[1].endswith("predicted cached tokens not read")
    assert report.exact_lines([row(report.EVENTS, 0, 0.9, 2.0), row(report.REPLICAS, 0, 0.9, 2.0)]) == []


def test_each_bypass_is_judged_request_by_request_where_the_rows_carry_the_checks() -> None:
    checks = {"bypasses": 10, "checked": 9, "equal": 8, "differ": [["r7", 130, 258]], "unchecked": ["r9"]}
    same = [{"turns": 6, "same": 6}, {"turns": 6, "same": 5}]
    one = row(
        report.EVENTS,
        0,
        0.9,
        2.0,
        bypass_by_replica=[routes(12, 10)],
        bypass_checks={**checks, "equal": 9, "differ": []},
    )
    many = row(report.REPLICAS, 0, 0.9, 2.0, bypass_by_replica=[routes(6, 5), routes(6, 5)], bypass_checks=checks)
    lines = report.exact_lines([one, {**many, "same_route_as_one_router": same}])
    assert lines[1].endswith("on 9 of 9 (target: every one: met); unchecked (no usage reached the decider): r9")
    assert "on 8 of 9 (target: every one: not met); differ (request, predicted, computed): ('r7', 130, 258)" in lines[2]
    assert lines[3] == "  - each replica's route against one router's on the same turn: 6 of 6, 5 of 6 (not all)"
    assert not [x for x in report.targets([one, many]) if "within 20 %" in x]
    same = [{"turns": 6, "same": 6, "one_bypass": 5}, {"turns": 4, "same": 4, "one_bypass": 2}]
    line = report.exact_lines([one, {**many, "same_route_as_one_router": same}])[3]
    assert line.endswith(
        "6 of 6, 4 of 4 (all); one router bypassed 5 of 6, 2 of 4 of the same turns (the rotation's own"
        " spread: 33.3 points)"
    )  # the ±20 % line: older rows only


def test_the_reproduce_line_names_issue_40s_fields_when_set() -> None:
    plan = {"replicas": 2, "sessions": 6, "api": "both", "burst": 3, "system_shared": True, "events_off_row": False}
    line = report.reproduce({**plan, "system_tokens": 1000})
    assert "--set api=both --set burst=3 --set system_tokens=1000 --set system_shared=true" in line
    assert "--set events_off_row=false" in line
    assert "--set peer_kv_aware=true" in report.reproduce({**plan, "peer_kv_aware": True, "estimate_row": False})
    assert "api=" not in report.reproduce({"replicas": 2, "api": "chat"})


def test_the_peer_line_holds_kvpush_replicas_against_vllm_routers_kv_aware_replicas() -> None:
    p50 = {"ttft_ms_turn2plus": {"p50": 40.0}}
    one = row(report.EVENTS, 0, 0.9, 2.0, bypass_by_replica=[routes(12, 10)])
    many = row(report.REPLICAS, 0, 0.9, 2.0, bypass_by_replica=[routes(6, 5), routes(6, 5)], **p50)
    peers = [row(report.PEER, 0, 0.9, 2.0, ttft_ms_turn2plus={"p50": 60.0})]
    peers.append(row(report.PEER_REPLICAS, 0, 0.9, 2.0, ttft_ms_turn2plus={"p50": 50.0}))
    peers[0]["ttft_ms_turn2plus"] = {"p50": 60.04}
    last = report.exact_lines([one, many, *peers])[-1]
    assert "50.0 ms behind the replicas, 60.0 ms behind one" in last
    assert last.endswith("kvpush's replicas 40.0 ms: 0.80x (loopback target <= 1.0: met)")


def test_the_tokenizers_cpu_is_judged_against_the_estimate_router_in_the_same_repeat() -> None:
    rows = [row(report.EVENTS, 0, 0.9, 2.6), row(report.REPLICAS, 0, 0.9, 2.6), row(report.ESTIMATE, 0, 0.9, 2.0)]
    line = [x for x in report.targets(rows) if "tokenizer option on / off" in x]
    assert line == [
        "- router CPU per turn, tokenizer option on / off (one router, events on): 1.30 (per repeat:"
        " 1.30; target <= 1.3: met)"
    ]
    assert not [x for x in report.targets(rows[:2]) if "tokenizer option" in x]


def test_the_head_names_only_the_fronts_the_run_had() -> None:
    rows = [row(report.EVENTS, 0, 0.9, 2.0), row(report.REPLICAS, 0, 0.9, 2.0), row(report.PEER, 0, 0.9, 2.0)]
    head = report.section(rows)[0]
    assert "vllm-router 0.1.17's `kv_aware` behind one router" in head and "events off" not in head
