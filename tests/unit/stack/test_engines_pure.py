"""stack.engines without processes: spec validation, port resolution, the exact command and environment."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from stack.engines import (
    KV_EVENT_OFFSETS,
    REPO_ROOT,
    EngineSpec,
    engine_argv,
    kv_transfer_config,
    process_spec,
    resolve_ports,
    vllm_env,
)

MODEL = Path("/models/tiny")


def spec(**overrides: object) -> EngineSpec:
    fields: dict[str, object] = {"name": "p0", "role": "prefill", "model": MODEL, "http_port": 8100, "core": 0}
    fields.update(overrides)
    return EngineSpec(**fields)  # type: ignore[arg-type]


def push_prefill(**overrides: object) -> EngineSpec:
    return spec(connector="NixlPushConnector", side_port=5600, engine_id="p-id", **overrides)


def counter(start: int = 40000) -> itertools.count[int]:
    return itertools.count(start)


class TestValidation:
    def test_a_plain_single_engine_is_valid(self) -> None:
        assert spec(role="single").effective_kv_role is None

    @pytest.mark.parametrize(
        ("overrides", "fragment"),
        [
            ({"name": "a b"}, "name"),
            ({"name": ""}, "name"),
            ({"role": "router"}, "role"),
            ({"http_port": 70000}, "http_port"),
            ({"side_port": -1, "connector": "NixlConnector"}, "side_port"),
            ({"core": -1}, "core"),
            ({"max_model_len": 0}, "max_model_len"),
            ({"served_model_name": ""}, "served_model_name"),
            ({"engine_id": "x"}, "need a connector"),
            ({"connector_module": "connector.plugin"}, "need a connector"),
            ({"kv_role": "kv_producer"}, "need a connector"),
            ({"connector_extra": {"a": 1}}, "need a connector"),
            ({"connector": "NixlConnector", "kv_role": "kv_consumer"}, "cannot be kv_consumer"),
            ({"role": "decode", "connector": "NixlConnector", "kv_role": "kv_producer"}, "cannot be kv_producer"),
            ({"connector": "NixlConnector", "kv_role": "kv_sometimes"}, "kv_role must be one of"),
            ({"extra_args": ("--port", "9")}, "--port"),
            ({"extra_args": ("--kv-transfer-config={}",)}, "--kv-transfer-config"),
        ],
    )
    def test_invalid_specs_are_rejected_with_the_reason(self, overrides: dict[str, object], fragment: str) -> None:
        with pytest.raises(ValueError, match="invalid engine spec") as info:
            spec(**overrides)
        assert fragment in str(info.value)

    def test_several_problems_are_joined(self) -> None:
        with pytest.raises(ValueError) as info:
            spec(core=-1, max_model_len=0)
        assert "core" in str(info.value)
        assert "max_model_len" in str(info.value)

    @pytest.mark.parametrize(
        ("role", "expected"), [("prefill", "kv_producer"), ("decode", "kv_consumer"), ("single", "kv_both")]
    )
    def test_kv_role_defaults_from_the_role(self, role: str, expected: str) -> None:
        assert spec(role=role, connector="NixlConnector").effective_kv_role == expected


class TestPorts:
    def test_zero_ports_are_picked_and_given_ports_kept(self) -> None:
        picks = counter()
        resolved = resolve_ports(spec(http_port=0, connector="NixlConnector", side_port=0), lambda: next(picks))
        assert (resolved.http_port, resolved.side_port) == (40000, 40001)
        assert resolve_ports(push_prefill(), lambda: next(picks)) == push_prefill()

    def test_a_connector_always_gets_a_side_port(self) -> None:
        resolved = resolve_ports(spec(connector="NixlConnector"), lambda: 5999)
        assert resolved.side_port == 5999

    def test_a_plain_engine_gets_no_side_port(self) -> None:
        assert resolve_ports(spec(http_port=0), lambda: 41000).side_port is None

    def test_the_command_needs_resolved_ports(self) -> None:
        with pytest.raises(ValueError, match="resolve ports"):
            engine_argv(spec(http_port=0))


class TestCommand:
    def test_plain_engine_command_is_exact(self) -> None:
        argv = engine_argv(spec(role="single", core=1, http_port=8300), python="/venv/bin/python")
        assert argv == (
            "taskset",
            "-c",
            "1",
            "/venv/bin/python",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "/models/tiny",
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            "8300",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--enable-prompt-tokens-details",
        )

    def test_connector_engine_carries_the_kv_transfer_config_then_extra_args(self) -> None:
        argv = engine_argv(push_prefill(extra_args=("--block-size", "32")), python="py")
        flag = argv.index("--kv-transfer-config")
        assert json.loads(argv[flag + 1]) == {
            "kv_connector": "NixlPushConnector",
            "kv_role": "kv_producer",
            "kv_buffer_device": "cpu",
            "engine_id": "p-id",
        }
        assert argv[-2:] == ("--block-size", "32")

    def test_our_connector_is_loaded_by_module_path_with_extra_config(self) -> None:
        config = kv_transfer_config(
            spec(
                role="decode",
                connector="KvpushConnector",
                connector_module="connector.plugin",
                connector_extra={"poll_ms": 1},
            )
        )
        assert config == {
            "kv_connector": "KvpushConnector",
            "kv_role": "kv_consumer",
            "kv_buffer_device": "cpu",
            "kv_connector_module_path": "connector.plugin",
            "kv_connector_extra_config": {"poll_ms": 1},
        }

    def test_plain_engine_has_no_kv_transfer_config(self) -> None:
        assert kv_transfer_config(spec()) is None
        assert "--kv-transfer-config" not in engine_argv(spec())


class TestEnvironment:
    def test_stack_settings_override_the_base_and_keep_the_rest(self) -> None:
        base = {"PATH": "/bin", "VLLM_HOST_IP": "10.0.0.1", "PYTHONPATH": "/elsewhere"}
        env = vllm_env(core=1, side_port=5601, repo_root=Path("/repo"), base=base)
        assert env == {
            "PATH": "/bin",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "UCX_NET_DEVICES": "lo",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601",
            "PYTHONPATH": "/repo/stack/site:/repo",
            "KVPUSH_NIXL_NO_PROG_THREAD": "1",
            "KVPUSH_KEEP_AFFINITY": "1",
            "KVPUSH_KEEP_AFFINITY_CORES": "1",
        }

    def test_without_side_port_an_inherited_one_is_dropped(self) -> None:
        env = vllm_env(core=0, side_port=None, base={"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"})
        assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env

    def test_base_is_not_modified(self) -> None:
        base = {"PATH": "/bin"}
        vllm_env(core=0, side_port=1, base=base)
        assert base == {"PATH": "/bin"}

    def test_openmp_is_bound_once_per_worker_rank(self) -> None:
        assert vllm_env(core=0, side_port=None, base={}, ranks=2)["VLLM_CPU_OMP_THREADS_BIND"] == "0|0"

    def test_an_engine_with_data_parallel_ranks_gets_one_bind_list_per_rank(self) -> None:
        dp2 = dataclasses.replace(push_prefill(), extra_args=("--data-parallel-size", "2"))
        dp3 = dataclasses.replace(push_prefill(), extra_args=("--data-parallel-size=3",))
        assert (push_prefill().dp_size, dp2.dp_size, dp3.dp_size) == (1, 2, 3)
        bind = process_spec(dp2, Path("/logs"), python="py", base_env={}).env["VLLM_CPU_OMP_THREADS_BIND"]
        assert bind == "|".join([str(dp2.core)] * 2)

    def test_every_tensor_parallel_rank_of_every_data_parallel_rank_gets_a_bind_list_on_the_engine_core(self) -> None:
        tp2 = dataclasses.replace(push_prefill(), core=1, extra_args=("--tensor-parallel-size", "2"))
        both = dataclasses.replace(tp2, extra_args=("--tensor-parallel-size=2", "--data-parallel-size", "2"))
        assert (tp2.tp_size, tp2.cpu_ranks, both.cpu_ranks) == (2, 2, 4)
        binds = [process_spec(s, Path("/logs"), python="py", base_env={}).env for s in (tp2, both)]
        assert [env["VLLM_CPU_OMP_THREADS_BIND"] for env in binds] == ["1|1", "1|1|1|1"]

    def test_the_harness_folder_exists_where_the_env_points(self) -> None:
        site = vllm_env(core=0, side_port=None, base={})["PYTHONPATH"].split(":")[0]
        assert (Path(site) / "sitecustomize.py").is_file()
        assert Path(site) == REPO_ROOT / "stack" / "site"


def test_process_spec_logs_by_name_and_waits_for_health() -> None:
    proc = process_spec(push_prefill(), Path("/logs"), python="py", base_env={})
    assert proc.log_path == Path("/logs/p0.log")
    assert proc.ready_url == "http://127.0.0.1:8100/health"
    assert proc.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert proc.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert proc.argv[:3] == ("taskset", "-c", "0")


def test_a_spread_start_runs_on_its_start_cores_and_keeps_vllm_moves_on_its_own_core() -> None:
    proc = process_spec(push_prefill(), Path("/logs"), python="py", base_env={}, start_cores=[1, 0])
    assert proc.argv[:3] == ("taskset", "-c", "0,1")
    assert proc.env["KVPUSH_KEEP_AFFINITY_CORES"] == "0"  # the engine's core, whatever it starts on
    assert proc.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"


class TestPrefillArg:
    def test_a_connector_engine_is_named_with_its_nixl_identity(self) -> None:
        assert push_prefill().prefill_arg() == "http://127.0.0.1:8100,engine_id=p-id,side_port=5600"

    def test_without_an_engine_id_the_router_learns_the_identity(self) -> None:
        assert spec(connector="NixlPushConnector", side_port=5600).prefill_arg() == "http://127.0.0.1:8100"
        assert spec().prefill_arg() == "http://127.0.0.1:8100"

    def test_an_unresolved_port_cannot_be_named(self) -> None:
        with pytest.raises(ValueError, match="resolve ports"):
            spec(http_port=0).prefill_arg()

    def test_the_router_s_parser_reads_it_back(self) -> None:
        from router.config import parse_prefill_spec

        worker = parse_prefill_spec(push_prefill().prefill_arg())
        assert worker.url == "http://127.0.0.1:8100"
        assert worker.identity is not None
        assert (worker.identity.engine_id, worker.identity.host, worker.identity.port) == ("p-id", "127.0.0.1", 5600)

    def test_a_tensor_parallel_prefill_states_its_tp_size_to_the_router(self) -> None:
        from router.config import parse_prefill_spec

        tp2 = dataclasses.replace(push_prefill(), extra_args=("--tensor-parallel-size", "2"))
        assert tp2.prefill_arg().endswith(",side_port=5600,tp=2")
        identity = parse_prefill_spec(tp2.prefill_arg()).identity
        assert identity is not None and identity.tp_size == 2


def test_every_engine_reports_its_cached_prompt_tokens() -> None:
    assert "--enable-prompt-tokens-details" in engine_argv(spec())


def test_an_engine_with_kv_events_publishes_on_its_http_port_plus_the_offsets() -> None:
    s = spec(http_port=8200, kv_events=KV_EVENT_OFFSETS)
    argv = engine_argv(s)
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:9200",
        "replay_endpoint": "tcp://*:10200",
        "topic": "",
    }
    assert s.kv_event_ports() == [9200, 10200]
    assert "--kv-events-config" not in engine_argv(spec(http_port=8200))
    ranks = spec(http_port=8200, kv_events=(1000, 2000), extra_args=("--data-parallel-size", "2"))
    assert ranks.kv_event_ports() == [9200, 9201, 10200, 10201]


def test_a_picked_port_leaves_the_kv_event_ports_free() -> None:
    picks = iter([40000, 45000])
    taken = {42000}  # 40000's replay port
    found = resolve_ports(spec(http_port=0, kv_events=(1000, 2000)), lambda: next(picks), lambda p: p not in taken)
    assert found.http_port == 45000
