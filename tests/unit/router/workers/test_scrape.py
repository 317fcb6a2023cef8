"""Engine load scraping: the Prometheus text parser and the scraper's per-worker results (no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import httpx
import pytest

from router.domain import Role, WorkerSpec
from router.metrics import Metrics
from router.workers.pool import Pool
from router.workers.scrape import EngineLoad, ScrapeError, Scraper, parse_engine_load, samples

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen/Qwen3-32B"} 3.0
vllm:num_requests_running{engine="1",model_name="qwen/Qwen3-32B"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen/Qwen3-32B"} 0.0
vllm:num_requests_waiting{engine="1",model_name="qwen/Qwen3-32B"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen/Qwen3-32B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="qwen/Qwen3-32B"} 0.75
vllm:num_requests_running_total_ever{engine="0"} 99
vllm:prompt_tokens_total{engine="0",model_name="qwen/Qwen3-32B"} 12345.0
vllm:prompt_tokens_created{engine="0",model_name="qwen/Qwen3-32B"} 1.7e+09
python_gc_objects_collected_total{generation="0"} 1.0 1732900000000
"""


def test_a_vllm_page_sums_requests_over_engines_and_averages_kv_usage() -> None:
    assert parse_engine_load(PAGE) == EngineLoad(running=7, waiting=2, kv_usage=0.5)


def test_label_values_may_hold_braces_spaces_and_escaped_quotes() -> None:
    text = 'vllm:num_requests_running{model_name="a } b \\" {c",x="y"} 5\nvllm:num_requests_waiting 1 1700000000\n'
    assert list(samples(text)) == [("vllm:num_requests_running", 5.0), ("vllm:num_requests_waiting", 1.0)]
    assert parse_engine_load(text) == EngineLoad(5, 1, 0.0)  # no KV gauge: usage unknown, taken as 0


def test_malformed_lines_of_other_metrics_are_not_read_but_the_generic_parser_refuses_them() -> None:
    text = 'vllm:num_requests_running 1\nvllm:num_requests_waiting 2\n<html>\nother{a="1" 3\n'
    assert parse_engine_load(text) == EngineLoad(1, 2, 0.0)
    with pytest.raises(ScrapeError, match="not a sample line"):
        list(samples(text))


def test_the_older_kv_gauge_name_is_understood_and_nan_is_ignored() -> None:
    text = (
        "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
        'vllm:gpu_cache_usage_perc{engine="0"} 0.4\nvllm:gpu_cache_usage_perc{engine="1"} NaN\n'
    )
    assert parse_engine_load(text) == EngineLoad(0, 0, 0.4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no vllm:num_requests_running or vllm:num_requests_waiting"),
        ("vllm:num_requests_running 1\n", "no vllm:num_requests_waiting"),
        ("<html>503</html>", "no vllm:num_requests_running"),
        ('vllm:num_requests_running{engine="0" 1\n', "unclosed label set"),
        ("vllm:num_requests_running\n", "without a value"),
        ("vllm:num_requests_running many\n", "not a number"),
    ],
)
def test_pages_without_the_gauges_or_with_broken_lines_are_refused(text: str, message: str) -> None:
    with pytest.raises(ScrapeError, match=message):
        parse_engine_load(text)


class Sink:
    def __init__(self) -> None:
        self.loads: dict[str, EngineLoad | None] = {}
        self.ranks: dict[str, Mapping[int, EngineLoad] | None] = {}
        self.block_sizes: dict[str, int | None] = {}

    def set_load(
        self,
        worker_id: str,
        load: EngineLoad | None,
        ranks: Mapping[int, EngineLoad] | None = None,
        block_size: int | None = None,
    ) -> None:
        self.loads[worker_id] = load
        self.ranks[worker_id] = ranks
        self.block_sizes[worker_id] = block_size


GOOD, BROKEN, SLOW, GARBAGE, GONE = (
    WorkerSpec(f"http://{h}:8000", Role.DECODE) for h in ("good", "broken", "slow", "garbage", "gone")
)


async def handler(request: httpx.Request) -> httpx.Response:
    assert request.url.path == "/metrics"
    host = request.url.host
    if host == "slow":
        await asyncio.sleep(30)
    if host == "gone":
        raise httpx.ConnectError("connection refused", request=request)
    if host == "broken":
        return httpx.Response(500, text="engine dead")
    return httpx.Response(200, text=PAGE if host == "good" else "<html>oops</html>")


async def test_each_worker_gets_its_load_or_none_and_failures_are_reported() -> None:
    sink, errors = Sink(), []
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        scraper = Scraper(
            client,
            lambda: [GOOD, BROKEN, SLOW, GARBAGE, GONE],
            sink,
            interval=1.0,
            timeout=0.05,
            on_error=lambda spec, reason: errors.append((spec.id, reason)),
        )
        await scraper.scrape_once()
    assert sink.loads == {
        GOOD.id: EngineLoad(7, 2, 0.5),
        BROKEN.id: None,
        SLOW.id: None,
        GARBAGE.id: None,
        GONE.id: None,
    }
    reasons = dict(errors)
    assert set(reasons) == {BROKEN.id, SLOW.id, GARBAGE.id, GONE.id}
    assert reasons[BROKEN.id] == "HTTP 500" and "0.05 s" in reasons[SLOW.id]
    assert "no vllm:num_requests_running" in reasons[GARBAGE.id] and "ConnectError" in reasons[GONE.id]


async def test_the_targets_are_asked_afresh_every_round() -> None:
    rounds = [[GOOD], [GOOD, BROKEN], []]
    seen: list[set[str]] = []
    sink = Sink()

    class Stop(Exception):
        pass

    async def sleep(delay: float) -> None:
        seen.append(set(sink.loads))
        sink.loads.clear()
        if not rounds:
            raise Stop

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        scraper = Scraper(client, lambda: rounds.pop(0), sink, interval=1.0, timeout=1.0, sleep=sleep)
        with pytest.raises(Stop):
            await scraper.run()
    assert seen == [{GOOD.id}, {GOOD.id, BROKEN.id}, set()]


async def test_the_routers_pool_is_a_load_sink_and_its_views_carry_the_load() -> None:
    pool = Pool([GOOD, BROKEN], Metrics())
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        await Scraper(client, pool.all_members, pool, interval=1.0, timeout=1.0).scrape_once()
    good, broken = pool.get(GOOD.id).view(), pool.get(BROKEN.id).view()
    assert (good.load_known, good.engine_running, good.engine_waiting, good.kv_usage) == (True, 7, 2, 0.5)
    assert not broken.load_known


async def test_a_scrape_that_raises_a_non_httpx_error_fails_that_worker_only() -> None:
    odd = WorkerSpec("http://odd:8000", Role.DECODE)

    async def raising(request: httpx.Request) -> httpx.Response:
        if request.url.host == "odd":
            raise ValueError("Cannot combine AUTHORIZATION header with AUTH argument")
        return await handler(request)

    sink, errors = Sink(), list[tuple[str, str]]()
    async with httpx.AsyncClient(transport=httpx.MockTransport(raising)) as client:
        scraper = Scraper(
            client,
            lambda: [GOOD, odd],
            sink,
            interval=1.0,
            timeout=1.0,
            on_error=lambda spec, reason: errors.append((spec.id, reason)),
        )
        await scraper.scrape_once()
    assert sink.loads == {GOOD.id: EngineLoad(7, 2, 0.5), odd.id: None}
    assert errors == [(odd.id, "ValueError: Cannot combine AUTHORIZATION header with AUTH argument")]
