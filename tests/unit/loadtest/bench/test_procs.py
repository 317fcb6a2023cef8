import os
import threading
import time
from pathlib import Path

import pytest

from loadtest.bench import procs
from loadtest.bench.procs import group_cpu_seconds, group_peak_rss_mb
from loadtest.promtext import parse

BEFORE = parse(
    'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} 100\n'
    'vllm:prompt_tokens_by_source_total{source="local_compute"} 5\n'
    "kvpush_sim_steps_total 10\nkvpush_sim_modeled_seconds_total 1.0\nkvpush_sim_lag_seconds_total 0.01\n"
)
AFTER = parse(
    'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} 400\n'
    'vllm:prompt_tokens_by_source_total{source="local_compute"} 5\n'
    "kvpush_sim_steps_total 110\nkvpush_sim_modeled_seconds_total 2.0\nkvpush_sim_lag_seconds_total 0.11\n"
)


def test_own_process_group_has_cpu_time_and_memory() -> None:
    pgid = os.getpgid(0)
    assert group_cpu_seconds(pgid) > 0
    assert group_peak_rss_mb(pgid) > 0


def test_side_threads_cpu_counts_the_threads_besides_the_main_one() -> None:
    pid = os.getpid()
    before = procs.side_threads_cpu_ns(pid)
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:  # the main thread works: not counted
        pass
    assert procs.side_threads_cpu_ns(pid) - before < 40_000_000
    done = threading.Event()

    def work() -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        done.set()
        time.sleep(0.5)  # still alive when read (an ended thread is not counted)

    worker = threading.Thread(target=work)
    worker.start()
    assert done.wait(10.0)
    assert procs.side_threads_cpu_ns(pid) - before >= 50_000_000 * 0.9
    worker.join(10.0)
    assert procs.side_threads_cpu_ns(-1) == 0  # no such process


def test_the_vllm_lock_is_not_taken_twice_under_an_ancestor_that_holds_it(tmp_path: Path) -> None:
    lock = tmp_path / "l.lock"
    assert not procs.lock_held_by_ancestor(lock)
    with procs.vllm_lock(lock):  # nobody holds it: taken here
        assert lock.exists()


def test_a_child_of_flock_sees_the_lock_as_held_and_does_not_take_it_again(tmp_path: Path) -> None:
    """`flock FILE python ...` (the team's wrapper) must not deadlock a suite that takes the same lock."""
    import shutil
    import subprocess
    import sys

    if shutil.which("flock") is None:
        pytest.skip("no flock(1)")
    lock = tmp_path / "l.lock"
    code = (
        "import sys; from pathlib import Path; from loadtest.bench import procs as b; p = Path(sys.argv[1]); "
        "held = b.lock_held_by_ancestor(p)\nwith b.vllm_lock(p): print(held)"
    )
    out = subprocess.run(
        ["flock", str(lock), sys.executable, "-c", code, str(lock)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_a_suite_s_router_flags_reach_the_router_command(tmp_path: Path) -> None:
    proc = procs.router_proc("r", 8123, "push", "http://p", "http://d", tmp_path, flags=("--timeout", "health=10"))
    argv = proc.spec.argv
    assert argv[-4:] == ("--log-level", "warning", "--timeout", "health=10")


def test_loop_thread_cpu_counts_the_main_thread_only() -> None:
    pid = os.getpid()
    before = procs.loop_thread_cpu_ns(pid)
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:  # the main thread works: counted
        pass
    assert procs.loop_thread_cpu_ns(pid) - before >= 50_000_000 * 0.9
    done = threading.Event()

    def work() -> None:
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        done.set()

    worker = threading.Thread(target=work)
    middle = procs.loop_thread_cpu_ns(pid)
    worker.start()
    assert done.wait(10.0)
    worker.join(10.0)
    assert procs.loop_thread_cpu_ns(pid) - middle < 150_000_000  # the other thread's 200 ms are not
    assert procs.loop_thread_cpu_ns(-1) == 0  # no such process
