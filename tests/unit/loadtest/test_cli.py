import math

import pytest

from loadtest.cli import job_from_args, main, parser


def test_run_arguments_become_a_job() -> None:
    argv = [
        "run",
        "--base-url",
        "http://h:1",
        "--qps",
        "2.5",
        "--burstiness",
        "0.5",
        "-n",
        "7",
        "--concurrency",
        "3",
        "--goodput",
        "ttft:100",
        "--suite",
        "seed-sim",
        "--mode",
        "pull",
    ]
    a = parser().parse_args(argv)
    job = job_from_args(a)
    assert job.load.num_requests == 7 and job.load.concurrency == 3
    assert job.load.arrivals.qps == 2.5 and job.load.arrivals.burstiness == 0.5
    assert job.slos_ms == {"ttft": 100.0}
    assert job.labels is not None and job.labels.mode == "pull" and job.labels.qps == 2.5


def test_defaults_send_as_fast_as_allowed_without_a_row() -> None:
    job = job_from_args(parser().parse_args(["run", "--base-url", "http://h:1"]))
    assert math.isinf(job.load.arrivals.qps) and job.labels is None


def test_summary_without_suite_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--base-url", "http://h:1", "--summary", "/tmp/x.json"]) == 2
    assert "--suite" in capsys.readouterr().err
