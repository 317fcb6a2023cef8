import asyncio
from pathlib import Path

import httpx
import pytest

from loadtest import job as job_module
from loadtest import timings
from loadtest.bench import point, procs
from loadtest.bench.point import kv_external_frac, kv_sources, sim_fidelity
from loadtest.job import Job
from loadtest.promtext import parse
from loadtest.results import RowLabels
from loadtest.runner import LoadConfig, RunResult
from loadtest.stats import Summary, summarize

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


def test_kv_sources_are_deltas_and_all_external_means_transferred() -> None:
    src = kv_sources(BEFORE, AFTER)
    assert src == {"external_kv_transfer": 300.0, "local_compute": 0.0}
    assert kv_external_frac(src) == 1.0
    assert kv_external_frac({"local_compute": 3.0, "external_kv_transfer": 1.0}) == 0.25
    assert kv_external_frac({}) is None


def test_sim_fidelity_is_lag_per_step_and_share_of_modeled_time() -> None:
    fid = sim_fidelity(BEFORE, AFTER)
    assert fid["lag_ms_per_step"] == pytest.approx(1.0)
    assert fid["lag_frac"] == pytest.approx(0.1)
    assert sim_fidelity(BEFORE, BEFORE) == {}


def test_wire_order_joins_p_and_d_legs_by_key_after_since() -> None:
    p = [("old", "prefill", 1.0), ("a", "prefill", 10.0), ("b", "prefill", 11.0)]
    d = [("old", "pull", 1.5), ("a", "push", 10.0002), ("b", "push", 11.0005), ("c", "push", 12.0)]
    out = point.wire_order(p, d, since=5.0)
    assert out["joined"] == 2 and out["d_kinds"] == {"push": 3}
    assert abs(out["d_after_p_ms_max"] - 0.5) < 1e-6


def test_an_unreadable_leg_log_is_noted_in_the_row_and_does_not_end_the_run() -> None:
    import httpx

    logs = {"http://p": [("a", "prefill", 10.0)], "http://d": [("a", "push", 10.001)]}

    def starved(url: str) -> list[tuple[str, str, float]]:
        if url == "http://d":
            raise httpx.ReadTimeout("timed out")
        return logs[url]

    noted = point.wire_order_or_note(("http://p", "http://d"), 5.0, read=starved)
    assert noted["wire_order"] is None and "ReadTimeout" in noted["wire_order_note"]
    fine = point.wire_order_or_note(("http://p", "http://d"), 5.0, read=logs.__getitem__)
    assert fine == {"wire_order": point.wire_order(logs["http://p"], logs["http://d"], 5.0)}


def test_fronts_loaded_together_need_distinct_labels_and_are_refused_before_any_load(tmp_path: Path) -> None:
    labels = RowLabels("same-pair", "kvpush", "push", "sim", 4.0, None, 64, 4)
    twins = [point.Point(labels, "http://127.0.0.1:9", 3, seed=k) for k in range(2)]
    with pytest.raises(ValueError, match="distinct labels"):
        point.measure_together(twins, tmp_path, tmp_path / "summary.json", progress=False)
    assert not (tmp_path / "summary.json").exists()


def test_the_fronts_cpu_is_read_when_the_load_is_done_not_after_the_harness_reads_its_timings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Serving GET /debug/timings (thousands of records) is the harness's cost, which vllm-router never pays."""
    readings = iter((10.0, 12.0, 50.0))  # before the load, when it is done, after the timings were read
    monkeypatch.setattr(procs, "group_cpu_seconds", lambda pid: next(readings))
    monkeypatch.setattr(procs, "group_peak_rss_mb", lambda pid: 1.0)

    async def execute(job: Job) -> tuple[RunResult, Summary]:
        assert job.on_loaded is not None
        job.on_loaded()  # the load is done ...
        procs.group_cpu_seconds(1)  # ... then the router timings are fetched (more CPU on the router)
        return RunResult([], 1.0, []), summarize([], 1.0)

    monkeypatch.setattr(point, "execute", execute)
    labels = RowLabels("overhead", "kvpush", "push", "sim", None, 1, 64, 4)
    measured = point.Point(labels, "http://127.0.0.1:9", 0, seed=1, warmup=1, router_timings=True)
    row = point.measure(measured, tmp_path, tmp_path / "summary.json", False, cpu_pid=1)
    assert row["cpu_s_per_1k"] == pytest.approx(2.0 / 1 * 1000)  # (12 - 10) s over the 1 warm-up request


def test_a_jobs_on_loaded_runs_after_the_load_and_before_the_router_timings_are_fetched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps: list[str] = []

    async def run_load(*args: object, **kwargs: object) -> RunResult:
        steps.append("load")
        return RunResult([], 1.0, [])

    async def fetch(*args: object, **kwargs: object) -> dict[str, dict[str, object]]:
        steps.append("timings")
        return {}

    monkeypatch.setattr(job_module, "run_load", run_load)
    monkeypatch.setattr(timings, "fetch", fetch)
    cfg = LoadConfig("http://127.0.0.1:9", "m", 8, 2, 1)
    job = Job(cfg, router_timings=True, progress=None, on_loaded=lambda: steps.append("loaded"))
    asyncio.run(job_module._send(job, cfg, httpx.AsyncClient(), []))
    assert steps == ["load", "loaded", "timings"]


def test_fronts_that_differ_only_in_tracing_or_kv_events_write_to_their_own_folders() -> None:
    """The overhead suite's push variants share router and mode: each keeps its own records."""

    def name(**extra: object) -> str:
        labels = RowLabels("overhead", "kvpush", "push", "sim", None, 64, 128, 16, {"repeat": 3, **extra})
        return point._name(point.Point(labels, "http://127.0.0.1:9", 1, seed=1))

    names = [name(tracing=t) for t in ("off", "control", "0.01", "1")] + [name(kv_events="on")]
    assert len(set(names)) == 5
    assert name(tracing="off", kv_events="off") == name() == "overhead-kvpush-push-sim-qNone-c64-r3"
