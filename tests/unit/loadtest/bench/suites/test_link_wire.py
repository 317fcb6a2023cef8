"""The link-wire suite's plans and rows (pure: no engine starts)."""

from __future__ import annotations

from loadtest.bench.suites import link_wire


def test_the_full_plan_covers_the_three_presets_with_repeats_and_one_write_per_prompt() -> None:
    assert link_wire.FULL.presets == ("efa-like", "ethernet-100g-like", "ethernet-25g-like")
    assert link_wire.FULL.repeats >= 3 and link_wire.FULL.prompt_tokens % 128 == 0
    assert link_wire.FULL.max_model_len > link_wire.FULL.prompt_tokens
    assert len(link_wire.SMOKE.presets) == 1 and link_wire.PEER.name == "nixl_peer.py" and link_wire.PEER.exists()


def test_a_row_carries_the_link_both_sides_times_the_verdict_and_the_bytes_check() -> None:
    row = link_wire.wire_row(
        link_wire.FULL,
        "r1",
        {"link": "ethernet-25g-like", "link_rate_bit_s": 6e7, "link_prompt_kv_bytes": 4 * 2**20},
        [0.60, 0.58, 0.59],
        [0.57, 0.58, 0.56],
        {"link_bytes_ok": True, "link_kv_bytes": 12 * 2**20},
    )
    assert row["suite"] == "link-wire" and row["run_id"] == "r1" and row["link"] == "ethernet-25g-like"
    assert row["wire_connector_times_ms"] == [600.0, 580.0, 590.0] and row["wire_bare_ms"] == 570.0
    assert row["wire_ok"] is True and row["link_bytes_ok"] is True and row["input_len"] == 1024
