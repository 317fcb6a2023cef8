"""The KV-event row's pure parts: stale bypasses from the routers' logs, and the row's verdict."""

from __future__ import annotations

import json

from loadtest.faults.events import Bypasses, Relay, _judge, judge_bypasses


def line(ts: str, predicted: int, computed: int) -> str:
    fields = {"predicted_uncached_tokens": predicted, "computed_tokens": computed, "request_id": "r"}
    return json.dumps({"ts": ts, "msg": f"bypass checked: predicted {predicted} uncached", **fields})


def test_a_bypass_is_stale_when_decode_computed_more_than_predicted() -> None:
    lines = [
        line("2026-12-07T16:00:00.000Z", 10, 10),
        line("2026-12-07T16:00:01.000Z", 10, 2),  # decode held more than the router knew: fine
        line("2026-12-07T16:00:02.000Z", 10, 300),  # credited blocks decode did not hold
        line("2026-12-07T15:59:59.000Z", 0, 500),  # before the row
        '{"ts": "2026-12-07T16:00:03.000Z", "msg": "request ok"}',
        "not json bypass checked",
    ]
    assert judge_bypasses(lines, "2026-12-07T16:00:00") == Bypasses(3, 1)


def test_the_row_needs_every_turn_served_both_replicas_noticing_and_no_stale_bypass() -> None:
    relay = Relay("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")  # not started: only its counts are read
    relay.dropped, relay.forwarded = 20, 400
    before = [{"gaps": 1.0, "restarts": 0.0}, {}]
    after = [{"gaps": 2.0, "restarts": 1.0, "replays": 1.0}, {"lost": 1.0, "restarts": 1.0}]
    good = _judge([200] * 9, before, after, [Bypasses(5, 0), Bypasses(4, 0)], relay, 30.0)
    assert good.acceptable and good.summary == "200 x9"
    assert "replica 0: gaps +1, replays +1, restarts +1, bypasses 5 checked, 0 stale" in good.note
    assert not _judge([200] * 9, before, after, [Bypasses(5, 1), Bypasses(4, 0)], relay, 30.0).acceptable
    assert not _judge([200, 502], before, after, [Bypasses(0, 0)] * 2, relay, 30.0).acceptable
    unseen = [{"gaps": 1.0, "restarts": 1.0}, {"lost": 1.0, "restarts": 1.0}]
    assert not _judge([200], before, unseen, [Bypasses(0, 0)] * 2, relay, 30.0).acceptable  # replica 0: no gap


def test_the_rows_replicas_decide_on_exact_tokens_as_the_stack_runs_them() -> None:
    from loadtest.faults import bed
    from loadtest.faults.events import ROUTER_CONFIG

    decider = ROUTER_CONFIG["decider"]
    assert isinstance(decider, dict) and decider["tokenizer"] == str(bed.MODEL_DIR)  # the bed's model
