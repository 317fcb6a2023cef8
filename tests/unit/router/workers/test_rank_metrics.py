"""router/workers/rank_metrics.py and router/workers/pairing.py: per-rank load (the `engine` label) and the block
size from a vLLM /metrics page, and the block-size refusal of a push pair."""

from __future__ import annotations

import pytest

from router.domain import EngineLoad
from router.workers.pairing import BlockSizes, block_size_mismatch
from router.workers.rank_metrics import MetricsPageError, block_size, labelled_samples, rank_loads

DP2_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 1.5
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",prefix="a}b\\"c"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",prefix=""} 1.0
"""


def test_each_rank_s_load_is_kept_apart() -> None:
    assert rank_loads(DP2_PAGE) == {0: EngineLoad(3, 2, 0.25), 1: EngineLoad(1, 0, 1.0)}


def test_a_page_without_the_engine_label_is_rank_0() -> None:
    page = "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\nvllm:gpu_cache_usage_perc 0.5\n"
    assert rank_loads(page) == {0: EngineLoad(2, 1, 0.5)}


def test_a_rank_without_both_request_gauges_is_left_out() -> None:
    page = 'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 1\n'
    page += 'vllm:num_requests_waiting{engine="1"} 0\nvllm:num_requests_waiting{engine="x"} 0\n'
    assert rank_loads(page) == {1: EngineLoad(1, 0, 0.0)}


def test_nan_samples_are_skipped() -> None:
    page = 'vllm:num_requests_running{engine="0"} NaN\nvllm:num_requests_waiting{engine="0"} 0\n'
    assert rank_loads(page) == {}


def test_the_block_size_is_read_from_the_cache_config_info() -> None:
    assert block_size(DP2_PAGE) == 16
    assert block_size("vllm:num_requests_running 1\n") is None
    assert block_size('vllm:cache_config_info{block_size="None"} 1\n') is None


def test_engines_that_disagree_on_the_block_size_are_a_scrape_error() -> None:
    page = (
        'vllm:cache_config_info{block_size="16",engine="0"} 1\nvllm:cache_config_info{block_size="32",engine="1"} 1\n'
    )
    with pytest.raises(MetricsPageError, match="different block sizes"):
        block_size(page)


@pytest.mark.parametrize(
    "line",
    [
        'vllm:num_requests_running{engine="0" 1',
        "vllm:num_requests_running{engine=0} 1",
        'vllm:num_requests_running{engine="0"}',
        'vllm:num_requests_running{engine="0"} one',
        "vllm:num_requests_running{" + "a" * 5000 + "} 1",
    ],
)
def test_malformed_lines_are_scrape_errors(line: str) -> None:
    with pytest.raises(MetricsPageError):
        list(labelled_samples(line, ("vllm:num_requests_running",)))


def test_other_metrics_sharing_a_prefix_are_not_parsed() -> None:
    assert list(labelled_samples("vllm:num_requests_running_total{bad 1\n", ("vllm:num_requests_running",))) == []


def test_labels_unescape_and_allow_a_trailing_comma() -> None:
    ((_, labels, value),) = labelled_samples('m{a="x\\"y",b="}",} 2\n', ("m",))
    assert labels == {"a": 'x"y', "b": "}"} and value == 2.0


@pytest.mark.parametrize(
    ("sizes", "refused"),
    [
        (BlockSizes(16, 16), False),
        (BlockSizes(16, None), False),
        (BlockSizes(None, 32), False),
        (BlockSizes(None, None), False),
        (BlockSizes(16, 32), True),
    ],
)
def test_a_pair_is_refused_only_when_both_sizes_are_known_and_differ(sizes: BlockSizes, refused: bool) -> None:
    why = block_size_mismatch(sizes)
    assert (why is not None) is refused
    if why is not None:
        assert "16" in why and "32" in why and "--block-size" in why and "http" not in why
