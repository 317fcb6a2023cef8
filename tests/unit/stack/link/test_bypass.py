"""The bypass threshold derived from the link: the base where moving KV is free, growing with transfer/prefill."""

from __future__ import annotations

import math

import pytest

from stack.link import bypass
from stack.link.plan import preset, resolve

KV_PER_TOKEN = 4096  # the bench model
PROMPT = 1024


def at(name: str, prefill_s: float = 0.12) -> int:
    plan = resolve(preset(name), prefill_s=prefill_s, kv_bytes=PROMPT * KV_PER_TOKEN)
    return bypass.for_link(plan, PROMPT)


def test_the_threshold_is_the_base_times_one_plus_transfer_over_prefill_per_token() -> None:
    # 4096 B/token at 32.768 Mbit/s: 1 ms per token; prefill 1000 tokens/s: 1 ms per token -> 2 x base
    got = bypass.threshold(kv_bytes_per_token=4096, goodput_bit_s=32.768e6, prefill_tokens_per_s=1000.0)
    assert got == 2 * bypass.BASE_TOKENS
    assert bypass.threshold(kv_bytes_per_token=4096, goodput_bit_s=None, prefill_tokens_per_s=1000.0) == 256
    assert bypass.threshold(kv_bytes_per_token=4096, goodput_bit_s=math.inf, prefill_tokens_per_s=1.0) == 256


def test_per_preset_it_follows_the_presets_share_whatever_the_box_measured() -> None:
    assert at("efa-like") == pytest.approx(256 * 1.038, abs=2)
    assert at("ethernet-100g-like") == pytest.approx(256 * 2.09, abs=2)
    assert at("ethernet-25g-like") == pytest.approx(256 * 5.38, abs=3)
    assert at("ethernet-25g-like", prefill_s=0.3) == pytest.approx(at("ethernet-25g-like"), abs=3)
    assert at("unshaped") == 256


def test_a_slower_link_for_the_same_prefill_raises_the_threshold() -> None:
    slow = bypass.threshold(kv_bytes_per_token=4096, goodput_bit_s=50e6, prefill_tokens_per_s=8000.0)
    fast = bypass.threshold(kv_bytes_per_token=4096, goodput_bit_s=500e6, prefill_tokens_per_s=8000.0)
    assert slow > fast > 256


def test_decider_options_add_the_threshold_unless_one_is_set() -> None:
    plan = resolve(preset("ethernet-25g-like"), prefill_s=0.12, kv_bytes=PROMPT * KV_PER_TOKEN)
    got = dict(bypass.decider_options((("block_tokens", 128.0),), plan, PROMPT))
    assert got == {"block_tokens": 128.0, "bypass_max_uncached_tokens": float(bypass.for_link(plan, PROMPT))}
    mine = (("bypass_max_uncached_tokens", 512.0),)
    assert bypass.decider_options(mine, plan, PROMPT) == mine


@pytest.mark.parametrize(
    "kw",
    [
        {"kv_bytes_per_token": 0, "goodput_bit_s": 1e6, "prefill_tokens_per_s": 1.0},
        {"kv_bytes_per_token": 1, "goodput_bit_s": 0.0, "prefill_tokens_per_s": 1.0},
        {"kv_bytes_per_token": 1, "goodput_bit_s": 1e6, "prefill_tokens_per_s": 0.0},
    ],
)
def test_nonsense_inputs_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        bypass.threshold(**kw)  # type: ignore[arg-type]
