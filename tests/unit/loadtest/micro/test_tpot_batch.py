"""TPOT against the batch it was made in: the overlaps per request and the fit."""

from __future__ import annotations

import random

import pytest

from loadtest.micro.tpot_batch import BatchSample, fit, samples, table


def _record(sent: float, ttft: float, e2e: float, tokens: int = 11) -> dict[str, object]:
    return {"ok": True, "sent": sent, "ttft_s": ttft, "e2e_s": e2e, "output_tokens": tokens}


def test_each_request_counts_the_requests_decoding_and_waiting_beside_it() -> None:
    # a decodes over [1, 3]; b waits over [0, 2] and decodes over [2, 3]; c fails and is not counted
    a, b = _record(0.0, 1.0, 3.0), _record(0.0, 2.0, 3.0)
    got = samples([a, b, {"ok": False, "sent": 0.0, "ttft_s": 0.0, "e2e_s": 0.0, "output_tokens": 0}])
    assert [(s.tpot_ms, round(s.decoding, 6), round(s.waiting, 6)) for s in got] == [
        (200.0, 1.5, 0.5),  # b decodes over half of a's span and waits over the other half
        (100.0, 2.0, 0.0),
    ]


def test_the_fit_finds_a_steps_time_per_request_decoding_and_waiting() -> None:
    rng = random.Random(7)
    points = []
    for _ in range(200):
        d, w = rng.uniform(1, 6), rng.uniform(0, 3)
        points.append(BatchSample(5.0 + 1.5 * d + 0.25 * w + rng.gauss(0, 0.01), d, w))
    f = fit("kvpush-push", points)
    assert (f.base_ms, f.per_decoding_ms, f.per_waiting_ms) == pytest.approx((5.0, 1.5, 0.25), abs=0.02)
    assert f.step_ms(4) == pytest.approx(11.0, abs=0.05) and f.r2 > 0.99
    assert "| kvpush-push | 200 | 5.00" in table([f])


def test_too_few_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="need at least 4"):
        fit("x", [BatchSample(1.0, 1.0, 0.0)])
