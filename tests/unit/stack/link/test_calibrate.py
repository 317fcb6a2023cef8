"""calibrate(): measured prefill (median after warm-up) -> resolved preset -> the link shaped with it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from stack.link.calibrate import calibrate, prompt_ids
from stack.link.plan import Shaping, preset


class FakeLink:
    def __init__(self) -> None:
        self.shaped: list[Shaping | None] = []

    def shape(self, shaping: Shaping | None) -> None:
        self.shaped.append(shaping)


def test_the_median_after_warm_up_sets_the_rate_and_the_record_keeps_the_times() -> None:
    times = iter([9.0, 0.30, 0.10, 0.20])  # the warm-up (9 s) is dropped
    seen: list[Sequence[int]] = []

    def probe(url: str, model: str, ids: Sequence[int]) -> float:
        assert (url, model) == ("http://10.231.1.1:8100", "tiny")
        seen.append(ids)
        return next(times)

    link = FakeLink()
    got = calibrate(
        link,
        preset("ethernet-25g-like"),
        "http://10.231.1.1:8100",
        prompt_tokens=512,
        kv_bytes_per_token=1024,
        probe=probe,
        seed=1,
    )
    assert got.prefill_times_s == (0.30, 0.10, 0.20) and got.plan.prefill_s == 0.20
    assert link.shaped == [got.plan.shaping] and got.plan.shaping is not None
    assert got.plan.expected_transfer_s == pytest.approx(4.38 * 0.20, rel=1e-6)
    assert got.record()["link_prefill_times_s"] == [0.3, 0.1, 0.2]
    assert len({tuple(ids[:8]) for ids in seen}) == 4 and all(len(ids) == 512 for ids in seen)


def test_prompt_ids_are_ordinary_tokens_and_reproducible() -> None:
    assert prompt_ids(64, 5) == prompt_ids(64, 5) != prompt_ids(64, 6)
    assert all(300 <= t < 2000 for t in prompt_ids(1000, 1))
