"""The decode profile's fold (loadtest/micro/decode_profile_fold.py): py-spy raw lines parsed, main-thread stacks
put in the step's parts (connector hooks named by the outermost connector frame, ours or vLLM's), other threads
counted whole, per-thread CPU named, and everything per step and per request."""

from __future__ import annotations

import pytest

from loadtest.micro.decode_profile_fold import Stack, fold, main_part, parse_raw, parts, table, thread_cpu, thread_label

VLLM = "/venv/lib/python3.11/site-packages/vllm"
LOOP = f"EngineCoreProc.run_busy_loop ({VLLM}/v1/engine/core.py:1555)"


def line(tid: int, thread: str, frames: list[str], count: int) -> str:
    return f"thread ({tid}): {';'.join([thread, *frames])} {count}"


def test_raw_lines_are_parsed_into_stacks_root_first() -> None:
    text = "\n".join(
        [
            line(11, "MainThread", [LOOP, f"Scheduler.schedule ({VLLM}/v1/core/sched/scheduler.py:1393)"], 7),
            line(12, "Thread-2 (process_output_sockets)", ["Queue.get (/py/queue.py:171)"], 3),
            "py-spy> a log line, not a sample",
        ]
    )
    stacks = parse_raw(text)
    assert [(s.tid, s.thread, s.count) for s in stacks] == [(11, "MainThread", 7), (12, "process_output_sockets", 3)]
    assert stacks[0].frames[-1] == ("Scheduler.schedule", f"{VLLM}/v1/core/sched/scheduler.py")
    assert stacks[1].frames == (("Queue.get", "/py/queue.py"),)


@pytest.mark.parametrize(
    ("name", "label"),
    [("Thread-7 (process_input_sockets)", "process_input_sockets"), ("nixl-handshake_0", "nixl-handshake")],
)
def test_thread_names_drop_pythons_numbering(name: str, label: str) -> None:
    assert thread_label(name) == label
    assert thread_label("kvpush-transfer") == "kvpush-transfer"


@pytest.mark.parametrize(
    ("frames", "part"),
    [
        # the outermost connector frame names the hook, whoever's code runs below it
        (
            [
                ("Scheduler.schedule", f"{VLLM}/v1/core/sched/scheduler.py"),
                ("KvpushConnector.get_num_new_matched_tokens", "/repo/connector/plugin.py"),
                ("SchedulerHalf.matched", "/repo/connector/scheduler.py"),
            ],
            "connector: get_num_new_matched_tokens",
        ),
        (
            [
                ("Worker.execute_model", f"{VLLM}/v1/worker/cpu_worker.py"),
                ("NixlConnector.get_finished", f"{VLLM}/distributed/kv_transfer/kv_connector/v1/nixl/connector.py"),
            ],
            "connector: get_finished",
        ),
        (
            [
                ("Runner.execute_model", f"{VLLM}/v1/worker/gpu_model_runner.py"),
                ("Module._call_impl", "/venv/torch/nn/modules/module.py"),
            ],
            "model forward",
        ),
        ([("Runner.sample", f"{VLLM}/v1/sample/sampler.py")], "sampling"),
        ([("Scheduler.schedule", f"{VLLM}/v1/core/sched/scheduler.py")], "scheduler"),
        (
            [
                ("EngineCore.step", f"{VLLM}/v1/engine/core.py"),
                ("MessageQueue.dequeue", f"{VLLM}/distributed/device_communicators/shm_broadcast.py"),
            ],
            "waiting on the other process (shm queue spin)",
        ),
        ([("EngineCore.step", f"{VLLM}/v1/engine/core.py")], "engine core loop: outputs, IO"),
        ([("<module>", "/x.py")], "other"),
    ],
)
def test_main_thread_stacks_fall_in_one_part(frames: list[tuple[str, str]], part: str) -> None:
    assert main_part(frames) == part


def test_other_threads_count_whole_and_every_key_names_its_process() -> None:
    stacks = [
        Stack(1, "MainThread", (("Scheduler.schedule", f"{VLLM}/v1/core/sched/scheduler.py"),), 4),
        Stack(2, "kvpush-transfer", (("TransferThread._turn", "/repo/connector/transfer_thread.py"),), 2),
        Stack(2, "kvpush-transfer", (("TransferThread._run", "/repo/connector/transfer_thread.py"),), 1),
    ]
    assert parts(stacks, "worker") == {"worker scheduler": 4, "worker thread: kvpush-transfer": 3}


def test_thread_cpu_is_the_difference_per_named_thread_and_new_threads_count_from_zero() -> None:
    before = {1: 1.0, 2: 5.0}
    after = {1: 1.5, 2: 5.25, 3: 0.125, 4: 0.5}
    names = {1: "MainThread", 2: "kvpush-transfer"}
    comms = {3: "gloo_tcp_loop", 4: "gloo_tcp_loop"}
    assert thread_cpu(before, after, names, comms) == {
        "MainThread": 0.5,
        "kvpush-transfer": 0.25,
        "native: gloo_tcp_loop": 0.625,
    }


def test_fold_gives_busy_ms_per_step_per_process_and_cpu_ms_per_request() -> None:
    sched = (("Scheduler.schedule", f"{VLLM}/v1/core/sched/scheduler.py"),)
    fwd = (("Module._call_impl", "/venv/torch/nn/modules/module.py"),)
    owner = (("TransferThread._turn", "/repo/connector/transfer_thread.py"),)
    stacks = {
        "core": [Stack(1, "MainThread", sched, 10)],
        "worker": [Stack(2, "MainThread", fwd, 100), Stack(3, "kvpush-transfer", owner, 5)],
    }
    out = fold(stacks, rate_hz=100.0, steps=50.0, requests=4, cpu_by_thread={"worker MainThread": 2.0})
    # 10 samples at 100 Hz = 100 ms over 50 steps = 2 ms per step
    assert out["ms_per_step"] == {
        "worker model forward": 20.0,
        "core scheduler": 2.0,
        "worker thread: kvpush-transfer": 1.0,
    }
    assert out["main_busy_ms_per_step"] == {"core": 2.0, "worker": 20.0}
    assert out["cpu_ms_per_request"] == {"worker MainThread": 500.0}
    assert out["cpu_ms_per_request_total"] == 500.0
    assert out["samples"] == 115


def test_the_table_takes_tpot_and_cpu_from_plain_points_and_the_split_from_sampled_ones() -> None:
    def point(sampled: bool, tpot: float, forward: float) -> dict[str, object]:
        return {
            "pair": "kvpush-push",
            "qps": 1.5,
            "sampled": sampled,
            "tpot_ms_mean": tpot,
            "ttft_ms_mean": 150.0,
            "decode_group_cpu_ms_per_request": 300.0,
            "cpu_ms_per_request": {"worker kvpush-transfer": 6.0, "worker MainThread": 200.0},
            "ms_per_step": {"worker model forward": forward, "worker connector: get_finished": 0.25},
            "steps": 100.0,
        }

    text = table([point(True, 9.0, 5.0), point(False, 7.5, 99.0)])
    row = text.splitlines()[2]
    assert row == "| kvpush-push | 1.5 | 7.50 | 150 | 300.0 | 6.0 | 5.00 | 0.250 | 0.000 | 0.000 | 100 |"
