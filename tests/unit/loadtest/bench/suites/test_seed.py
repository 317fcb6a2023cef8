from loadtest.bench.suites.seed import FULL, SMOKE
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


def test_seed_plan_sizes_points_by_rate() -> None:
    assert FULL.n_for(0.5) == 40 and FULL.n_for(2.0) == 60 and FULL.n_for(8.0) == 120
    assert FULL.input_len == 16384 and 8.0 in FULL.qps
    assert SMOKE.n_for(1.0) == 3 and SMOKE.n_for(2.0) == 4
