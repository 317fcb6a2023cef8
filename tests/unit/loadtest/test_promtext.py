from loadtest.promtext import by_label, parse, total

TEXT = """# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 2048.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 0.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="tiny",source="external_kv_transfer"} 1024.0
plain_metric 7
broken line here
"""


def test_parse_and_sum_by_labels() -> None:
    s = parse(TEXT)
    assert total(s, "vllm:num_requests_running") == 3.0
    assert total(s, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 3072.0
    assert by_label(s, "vllm:prompt_tokens_by_source_total", "source") == {
        "external_kv_transfer": 3072.0,
        "local_compute": 0.0,
    }
    assert total(s, "plain_metric") == 7.0
    assert total(s, "absent") == 0.0
