"""When each push connector posts its WRITE, relative to P's steps (writes.WritePlan)."""

from loadtest.sim.link import Fifo
from loadtest.sim.writes import PlannedWrite, WriteAt, WritePlan, post


def steps(plan: WritePlan, computed: list[int]) -> list[list[PlannedWrite]]:
    """Step ends 1..n with the given computed-token counts; what each step end posts."""
    return [plan.on_step_end(i + 1, c) for i, c in enumerate(computed)]


def test_completing_step_writes_the_whole_prompt_at_the_end_of_the_last_chunk() -> None:
    plan = WritePlan(WriteAt.COMPLETING_STEP, 300)
    assert plan.on_register() == []
    assert steps(plan, [100, 200, 300, 300]) == [[], [], [PlannedWrite(300, final=True)], []]
    assert plan.finished and not plan.wants_step


def test_next_step_writes_one_step_later_and_asks_for_that_step() -> None:
    plan = WritePlan(WriteAt.NEXT_STEP, 300)
    plan.on_register()
    assert steps(plan, [200, 300]) == [[], []]
    assert plan.wants_step  # P must run one more step (a no-forward one when idle)
    assert plan.on_step_end(3, 300) == [PlannedWrite(300, final=True)]
    assert not plan.wants_step


def test_per_step_writes_each_chunk_and_done_rides_the_last() -> None:
    plan = WritePlan(WriteAt.PER_STEP, 300)
    plan.on_register()
    assert steps(plan, [100, 200, 300]) == [
        [PlannedWrite(100, False)],
        [PlannedWrite(100, False)],
        [PlannedWrite(100, True)],
    ]


def test_per_step_with_a_late_registration_degrades_to_one_whole_write() -> None:
    plan = WritePlan(WriteAt.PER_STEP, 300)
    assert steps(plan, [100]) == [[]]
    assert plan.on_register() == []
    assert not plan.progressive
    assert steps(plan, [200, 300]) == [[], [PlannedWrite(300, final=True)]]


def test_a_due_write_leaves_at_registration() -> None:
    for mode, ends in ((WriteAt.COMPLETING_STEP, [300]), (WriteAt.NEXT_STEP, [300, 300])):
        plan = WritePlan(mode, 300)
        assert all(w == [] for w in steps(plan, ends))
        assert plan.on_register() == [PlannedWrite(300, final=True)], mode
    plan = WritePlan(WriteAt.NEXT_STEP, 300)
    steps(plan, [300])
    assert plan.on_register() == []  # not due yet: still one step to go
    assert plan.on_step_end(2, 300) == [PlannedWrite(300, final=True)]


def test_post_queues_setup_on_the_writer_then_the_link() -> None:
    writer, link = Fifo(), Fifo()
    done = post([PlannedWrite(10, False), PlannedWrite(10, True)], 0.0, writer, link, lambda n: 1.0, lambda n: 2.0, 0.5)
    # setups end at 1 and 2; transfers: 1 -> 3.5 (with the handshake), then 3.5 -> 5.5
    assert done == 5.5
    assert post([PlannedWrite(5, False)], 0.0, writer, link, lambda n: 1.0, lambda n: 1.0) is None
