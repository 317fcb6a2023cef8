"""The virtual-time 1P+1D pair: the connectors' WRITE timing seen in TTFT and handoff (pure, no sockets)."""

import dataclasses

import pytest

from loadtest.sim import costs, pair
from loadtest.sim.profile import load

QWEN = load("qwen3-32b-h200")


def one(mode: str, prompt: int = 16384) -> pair.RequestTimes:
    p = pair.PairModel(QWEN, mode, output_len=4)
    p.arrive("a", 0.0, prompt)
    p.clock.run()
    return p.outcomes["a"]


def test_lone_kvpush_push_request_is_api_prefill_setup_transfer_and_one_step() -> None:
    out = one("kvpush-push")
    api, pre = costs.api_time(QWEN, 16384), costs.prefill_time(QWEN, 16384)
    move = costs.setup_time(QWEN, 16384) + QWEN.handshake_s + costs.transfer_time(QWEN, 16384)
    step = costs.step_time(QWEN, [], [16384])
    assert out.ttft == pytest.approx(api + pre + move + QWEN.notify_s + step)
    assert out.done is not None and out.p_answer == pytest.approx(api + pre)


def test_upstream_push_on_an_idle_p_pays_one_no_forward_step() -> None:
    late, now = one("upstream-push"), one("kvpush-push")
    assert late.ttft is not None and now.ttft is not None
    assert late.ttft - now.ttft == pytest.approx(QWEN.step_overhead_s)


def test_progressive_hides_the_first_chunks_transfer_behind_the_last_chunk() -> None:
    prog, whole = one("kvpush-progressive"), one("kvpush-push")
    assert prog.handoff is not None and whole.handoff is not None
    assert prog.handoff < whole.handoff
    first_chunk = QWEN.max_batched_tokens
    # the first chunk's setup and transfer, and the first contact's handshake, all ride under the second chunk
    saved = costs.setup_time(QWEN, first_chunk) + costs.transfer_time(QWEN, first_chunk) + QWEN.handshake_s
    assert whole.handoff - prog.handoff == pytest.approx(saved, rel=0.05)


def test_under_load_upstream_push_waits_a_whole_prefill_step() -> None:
    """Two prompts back to back on P: upstream's first WRITE leaves after the second prompt's first chunk."""
    p = pair.PairModel(QWEN, "upstream-push", output_len=2)
    p.arrive("a", 0.0, 8192)
    p.arrive("b", 0.0, 8192)
    p.clock.run()
    q = pair.PairModel(QWEN, "kvpush-push", output_len=2)
    q.arrive("a", 0.0, 8192)
    q.arrive("b", 0.0, 8192)
    q.clock.run()
    late, now = p.outcomes["a"].handoff, q.outcomes["a"].handoff
    assert late is not None and now is not None
    assert late - now == pytest.approx(costs.step_time(QWEN, [(8192, 0)], []), rel=0.01)


def test_pull_pays_d_api_and_setup_after_p_answered() -> None:
    out = one("pull")
    assert out.handoff is not None
    api = costs.api_time(QWEN, 16384)
    assert out.handoff >= api + costs.setup_time(QWEN, 16384) + costs.transfer_time(QWEN, 16384)


def test_run_scores_after_warmup_and_rejects_unknown_modes() -> None:
    fast = dataclasses.replace(QWEN, handshake_s=0.0)
    s = pair.run(fast, "kvpush-push", [0.0, 1.0, 2.0, 3.0], 1024, 8, warmup=1)
    assert s.n == 3 and s.unfinished == 0 and s.ttft_mean_ms > 0 and s.tpot_mean_ms > 0
    with pytest.raises(ValueError):
        pair.PairModel(QWEN, "nope", 4)


def test_a_pull_only_serial_stage_queues_pull_and_leaves_push_alone() -> None:
    arrivals = [0.0, 0.0, 0.0, 0.0]
    base = pair.run(QWEN, "pull", arrivals, 2048, 4, warmup=0)
    slow = pair.run(QWEN, "pull", arrivals, 2048, 4, warmup=0, pull_serial_s=0.5)
    push = pair.run(QWEN, "kvpush-push", arrivals, 2048, 4, warmup=0, pull_serial_s=0.5)
    same = pair.run(QWEN, "kvpush-push", arrivals, 2048, 4, warmup=0)
    assert slow.ttft_mean_ms > base.ttft_mean_ms + 500  # four READs behind one another: 0.5, 1.0, 1.5, 2.0 s
    assert push.ttft_mean_ms == same.ttft_mean_ms
