import dataclasses
from typing import Any

import pytest

from loadtest.sim import costs
from loadtest.sim.engine import (
    EngineModel,
    LegKind,
    PrefillDone,
    Req,
    ScheduledStep,
    StartPull,
    StartPush,
    State,
    Token,
)
from loadtest.sim.profile import Profile, load

QWEN = load("qwen3-32b-h200")


def state_of(r: Req) -> State:
    """The request's state now (a call, so the type checker does not carry an earlier assert's narrowing)."""
    return r.state


def drain(e: EngineModel) -> tuple[float, list[Any]]:
    """Run steps until idle; returns total time and every event."""
    t, events = 0.0, list[Any]()
    while (step := e.plan()) is not None:
        t += step.duration
        events += e.complete(step)
    return t, events


def one_step(e: EngineModel) -> tuple[ScheduledStep, list[object]]:
    step = e.plan()
    assert step is not None
    return step, list(e.complete(step))


def test_local_prompt_is_chunked_then_decoded() -> None:
    p = dataclasses.replace(QWEN, max_batched_tokens=8192)
    e = EngineModel(p)
    r = Req("a", LegKind.LOCAL, prompt=20000, max_tokens=3)
    e.add(r)
    sizes = []
    for _ in range(3):
        step, ev = one_step(e)
        sizes.append(step.chunks[0][1])
    assert sizes == [8192, 8192, 3616]
    assert ev == [Token(r, final=False)]  # first token at the end of the last chunk
    step, ev = one_step(e)
    assert step.decodes == (r,) and ev == [Token(r, final=False)]
    _, ev = one_step(e)
    assert ev == [Token(r, final=True)] and r.state is State.DONE and e.used_tokens == 0
    assert e.plan() is None


def test_decodes_batch_into_one_step_and_take_budget_from_prefill() -> None:
    e = EngineModel(dataclasses.replace(QWEN, max_batched_tokens=100))
    a, b = Req("a", LegKind.LOCAL, 10, 5), Req("b", LegKind.LOCAL, 10, 5)
    e.add(a)
    e.add(b)
    step, _ = one_step(e)  # both prompts fit in one step
    assert [n for _, n in step.chunks] == [10, 10]
    c = Req("c", LegKind.LOCAL, 500, 2)
    e.add(c)
    step, _ = one_step(e)
    assert step.decodes == (a, b) and step.chunks == ((c, 98),)
    assert step.duration == pytest.approx(costs.step_time(e.profile, [(98, 0)], [11, 11]))


def test_prefill_leg_holds_kv_until_released() -> None:
    e = EngineModel(QWEN)
    r = Req("p", LegKind.PREFILL, 16384, 1)
    e.add(r)
    t, ev = drain(e)
    assert t == pytest.approx(costs.prefill_time(QWEN, 16384))
    assert ev[-2:] == [Token(r, final=True), PrefillDone(r)]
    assert r.state is State.HELD and e.used_tokens == 16385
    e.release(r)
    assert state_of(r) is State.DONE and e.used_tokens == 0


def test_pull_setup_stalls_the_admitting_step_push_does_not() -> None:
    for kind, extra in ((LegKind.PULL, costs.setup_time(QWEN, 16384)), (LegKind.PUSH, 0.0)):
        e = EngineModel(QWEN)
        running = Req("run", LegKind.LOCAL, 100, 50)
        e.add(running)
        one_step(e)  # its prefill
        leg = Req("d", kind, 16384, 4)
        e.add(leg)
        step, ev = one_step(e)
        assert step.duration == pytest.approx(costs.step_time(QWEN, [], [101]) + extra)
        assert ev[-1] == (StartPull(leg) if kind is LegKind.PULL else StartPush(leg))
        assert leg.state is State.WAIT_KV


def test_kv_landing_mid_step_counts_at_the_step_boundary() -> None:
    e = EngineModel(QWEN)
    other = Req("o", LegKind.LOCAL, 100, 50)
    leg = Req("d", LegKind.PUSH, 1000, 2)
    e.add(other)
    e.add(leg)
    one_step(e)
    step = e.plan()
    assert step is not None
    e.kv_landed(leg)  # arrives while the step runs
    assert leg.state is State.WAIT_KV
    e.complete(step)
    assert state_of(leg) is State.KV_READY
    step, ev = one_step(e)
    assert leg in step.decodes and Token(leg, final=False) in ev


def test_kv_capacity_queues_fifo_and_abort_frees() -> None:
    small: Profile = dataclasses.replace(QWEN, kv_capacity_tokens=150)
    e = EngineModel(small)
    a, b = Req("a", LegKind.LOCAL, 100, 10), Req("b", LegKind.LOCAL, 100, 10)
    e.add(a)
    e.add(b)
    one_step(e)
    assert a.state is State.DECODE and b.state is State.QUEUED and list(e.waiting) == [b]
    e.abort(a)
    assert e.used_tokens == 0
    one_step(e)
    assert b.state is not State.QUEUED


def single_ttft(kind: str) -> float:
    """One request on idle P and D, stepped by hand; the transfer happens between D's steps."""
    p_eng, d_eng = EngineModel(QWEN), EngineModel(QWEN)
    prompt = 16384
    leg = Req("p", LegKind.PREFILL, prompt, 1)
    p_eng.add(leg)
    prefill, _ = drain(p_eng)
    d = Req("d", LegKind.PULL if kind == "pull" else LegKind.PUSH, prompt, 8)
    d_eng.add(d)
    admit, _ = one_step(d_eng)
    xfer = costs.transfer_time(QWEN, prompt)
    if kind == "pull":  # D admits only after P answered; setup on D's loop, then the READ
        t = prefill + admit.duration + xfer
    else:  # D registered at t=0; P's writer sets up and WRITEs after prefill
        t = max(prefill + costs.setup_time(QWEN, prompt) + xfer, admit.duration)
    d_eng.kv_landed(d)
    first, ev = one_step(d_eng)
    assert ev == [Token(d, final=False)]
    return t + first.duration


def test_single_request_ttft_is_prefill_plus_transfer_plus_one_step() -> None:
    prefill = costs.prefill_time(QWEN, 16384)
    setup, xfer = costs.setup_time(QWEN, 16384), costs.transfer_time(QWEN, 16384)
    first_step = costs.step_time(QWEN, [], [16384])
    assert single_ttft("pull") == pytest.approx(prefill + setup + xfer + first_step)
    assert single_ttft("push") == pytest.approx(prefill + setup + xfer + first_step)
