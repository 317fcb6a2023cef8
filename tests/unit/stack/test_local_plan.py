"""stack.local decisions: which engines, which connector, the router command, the ready line, the flags."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import yaml

from router.config import Timeouts, build_settings
from stack.engines import engine_argv, process_spec
from stack.link.calibrate import Calibration
from stack.link.plan import Place, preset, resolve
from stack.local import (
    DEFAULT_CACHE_DIR,
    KVPUSH_CONNECTOR_CLASS,
    PREFILL_ENGINE_ID,
    StackOptions,
    connector_for,
    parse_args,
    plan_engines,
    plan_router,
    plan_routers,
    ready_line,
    router_config,
    stack_ports,
    write_router_config,
)
from stack.routers import router_argv, router_process


def kv_config(argv: tuple[str, ...]) -> dict[str, object]:
    return dict(json.loads(argv[argv.index("--kv-transfer-config") + 1]))


@pytest.mark.parametrize(
    ("mode", "choice", "expected"),
    [
        ("push", "upstream", ("NixlPushConnector", None)),
        ("pull", "upstream", ("NixlConnector", None)),
        ("push", "kvpush", (KVPUSH_CONNECTOR_CLASS, "connector.plugin")),
        ("push", "auto", (KVPUSH_CONNECTOR_CLASS, "connector.plugin")),
        ("pull", "auto", ("NixlConnector", None)),
    ],
)
def test_connector_choice(mode: str, choice: str, expected: tuple[str, str | None]) -> None:
    assert connector_for(mode, choice) == expected  # type: ignore[arg-type]


def test_our_connector_is_push_only() -> None:
    with pytest.raises(ValueError, match="push only"):
        connector_for("pull", "kvpush")


def test_default_push_stack_engines() -> None:
    options = StackOptions(cache_dir=Path("/c"))
    prefill, decode = plan_engines(options)
    assert (prefill.core, prefill.http_port, prefill.side_port) == (0, 8100, 5600)
    assert (decode.core, decode.http_port, decode.side_port) == (1, 8200, 5601)
    assert prefill.model == decode.model == Path("/c/models/tiny")
    assert kv_config(engine_argv(prefill)) == {
        "kv_connector": KVPUSH_CONNECTOR_CLASS,
        "kv_connector_module_path": "connector.plugin",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "engine_id": PREFILL_ENGINE_ID,
    }
    assert kv_config(engine_argv(decode)) == {
        "kv_connector": KVPUSH_CONNECTOR_CLASS,
        "kv_connector_module_path": "connector.plugin",
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cpu",
    }
    upstream, _ = plan_engines(StackOptions(connector="upstream"))
    assert upstream.connector == "NixlPushConnector"


def test_upstream_push_keeps_finished_blocks_longer_than_the_routers_decode_deadline() -> None:
    for engine in plan_engines(StackOptions(connector="upstream")):
        extra = kv_config(engine_argv(engine))["kv_connector_extra_config"]
        assert isinstance(extra, dict)
        assert extra["kv_lease_duration"] > Timeouts().decode_first_byte
    for engine in (*plan_engines(StackOptions()), *plan_engines(StackOptions(mode="pull"))):
        assert "kv_lease_duration" not in str(kv_config(engine_argv(engine)))


def test_pull_mode_uses_nixl_connector_on_both() -> None:
    prefill, decode = plan_engines(StackOptions(mode="pull"))
    assert prefill.connector == decode.connector == "NixlConnector"
    assert (prefill.effective_kv_role, decode.effective_kv_role) == ("kv_producer", "kv_consumer")


def test_our_connector_is_loaded_from_its_module() -> None:
    for engine in plan_engines(StackOptions(connector="kvpush")):
        assert kv_config(engine_argv(engine))["kv_connector_module_path"] == "connector.plugin"


def test_router_command_names_the_prefill_identity() -> None:
    options = StackOptions(python="py", port=8000)
    prefill, decode = plan_engines(options)
    assert router_argv(plan_router(options, prefill, decode), options.python) == (
        "py",
        "-m",
        "router",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--mode",
        "push",
        "--prefill",
        f"http://127.0.0.1:8100,engine_id={PREFILL_ENGINE_ID},side_port=5600",
        "--decode",
        "http://127.0.0.1:8200",
    )


def test_router_process_waits_for_ready_and_finds_the_repo() -> None:
    options = StackOptions(cache_dir=Path("/c"), port=8123)
    spec = plan_router(options, *plan_engines(options))
    proc = router_process(spec, options.log_dir, base_env={"PATH": "/bin", "PYTHONPATH": "/x"})
    assert proc.ready_url == "http://127.0.0.1:8123/ready"
    assert proc.log_path == Path("/c/logs/router.log")
    assert proc.env["PATH"] == "/bin"
    assert proc.env["PYTHONPATH"].split(":")[1:] == ["/x"]
    assert (Path(proc.env["PYTHONPATH"].split(":")[0]) / "router").is_dir()


def test_ready_line_is_one_line_with_a_working_curl() -> None:
    line = ready_line(StackOptions(port=8000), "http://127.0.0.1:8100", "http://127.0.0.1:8200")
    assert "\n" not in line
    curl = shlex.split(line.split("try: ", 1)[1])
    assert curl[:3] == ["curl", "-N", "http://127.0.0.1:8000/v1/chat/completions"]
    body = json.loads(curl[curl.index("-d") + 1])
    assert body["model"] == "tiny"
    assert body["stream"] is True
    assert body["messages"][0]["role"] == "user"


def test_flags_and_defaults(tmp_path: Path) -> None:
    assert parse_args([]) == StackOptions(cache_dir=DEFAULT_CACHE_DIR.resolve())
    options = parse_args(
        [
            "--mode",
            "pull",
            "--connector",
            "upstream",
            "--port",
            "9000",
            "--model-size",
            "bench",
            "--cache-dir",
            str(tmp_path),
            "--prefill-port",
            "0",
            "--decode-port",
            "0",
            "--startup-timeout",
            "5",
        ]
    )
    assert options == StackOptions(
        mode="pull",
        connector="upstream",
        port=9000,
        model_size="bench",
        cache_dir=tmp_path,
        prefill_port=0,
        decode_port=0,
        startup_timeout=5.0,
    )
    assert options.model_dir == tmp_path / "models" / "bench"
    assert parse_args(["--connector", "kvpush"]).connector == "kvpush"


def test_our_push_only_connector_with_pull_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--mode", "pull", "--connector", "kvpush"])
    assert "push only" in capsys.readouterr().err


def test_unknown_mode_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--mode", "sideways"])


def test_stack_ports_are_router_then_each_engines_http_and_side_port() -> None:
    options = StackOptions()
    assert stack_ports(options, plan_engines(options)) == [8000, 8100, 5600, 8200, 5601]


def test_link_flags_choose_a_preset_and_the_prompt_length(capsys: pytest.CaptureFixture[str]) -> None:
    options = parse_args(["--link", "ethernet-25g-like", "--link-prompt-tokens", "512"])
    assert (options.link, options.link_prompt_tokens) == ("ethernet-25g-like", 512)
    assert parse_args([]).link is None
    with pytest.raises(SystemExit):
        parse_args(["--link", "infiniband"])
    with pytest.raises(SystemExit):
        parse_args(["--link", "efa-like", "--link-prompt-tokens", "4096"])
    assert "--max-model-len is 2048" in capsys.readouterr().err


def test_an_engine_with_a_place_listens_on_its_address_inside_its_namespace() -> None:
    prefill, _ = plan_engines(StackOptions(cache_dir=Path("/c")))
    placed = dataclasses.replace(prefill, place=Place("prefill", "/proc/7/ns/net", "10.231.9.1"))
    argv = engine_argv(placed)
    assert argv[:3] == ("nsenter", "--net=/proc/7/ns/net", "--") and "taskset" in argv
    assert argv[argv.index("--host") + 1] == "10.231.9.1" and placed.url == "http://10.231.9.1:8100"
    assert placed.prefill_arg() == "http://10.231.9.1:8100,engine_id=kvpush-local-prefill,side_port=5600"
    env = process_spec(placed, Path("/c/logs")).env
    assert (env["UCX_TLS"], env["UCX_NET_DEVICES"], env["VLLM_NIXL_SIDE_CHANNEL_HOST"]) == ("tcp", "kvn0", "10.231.9.1")
    assert "KVPUSH_NIXL_NO_PROG_THREAD" not in env and env["KVPUSH_NIXL_PTHR_DELAY_US"] == "1000"
    assert "UCX_TLS" not in process_spec(prefill, Path("/c/logs")).env or prefill.place is None


def test_the_ready_line_says_the_link_rate_and_what_it_came_from() -> None:
    plan = resolve(preset("ethernet-100g-like"), prefill_s=0.25, kv_bytes=1024 * 1024)
    line = ready_line(
        StackOptions(link="ethernet-100g-like"),
        "http://10.231.1.1:8100",
        "http://10.231.1.2:8200",
        Calibration(plan, (0.25,)),
    )
    assert "\n" not in line
    assert (
        "link ethernet-100g-like: 32.2 Mbit/s, a 1024 KiB KV transfer ~272 ms = 1.09 x the measured prefill of 250 ms"
        in line
    )
    fast = resolve(preset("efa-like"), prefill_s=0.01, kv_bytes=4 * 1024 * 1024)
    assert "this box, not the shaper" in ready_line(StackOptions(), "p", "d", Calibration(fast, (0.01,)))


def test_two_replicas_follow_the_engines_kv_events_with_the_decider() -> None:
    options = parse_args(["--replicas", "2"])
    assert options.events and options.router_ports == [8000, 8001]
    prefill, decode = plan_engines(options)
    assert prefill.kv_event_ports() == [9100, 10100] and decode.kv_event_ports() == [9200, 10200]
    assert "--kv-events-config" in engine_argv(decode)
    specs = plan_routers(options, prefill, decode)
    assert [(s.name, s.port) for s in specs] == [("router0", 8000), ("router1", 8001)]
    argv = router_argv(specs[1], "py")
    flags = ["--kv-events", "--kv-events-port-offset", "1000", "--kv-events-replay-offset", "2000"]
    assert argv[-len(flags) :] == tuple(flags)
    assert specs[0].config == specs[1].config == options.router_config_path
    assert router_config(options) == {
        "decider": {"name": "session-affinity", "tokenizer": str(options.model_dir)}
    }  # both replicas check answers the other relayed against the engine's stored ids
    assert stack_ports(options, [prefill, decode]) == [8000, 8001, 8100, 5600, 9100, 10100, 8200, 5601, 9200, 10200]
    assert "routers http://127.0.0.1:8000, http://127.0.0.1:8001" in ready_line(options, prefill.url, decode.url)
    assert "--kv-events-config" not in engine_argv(plan_engines(StackOptions())[1])
    assert parse_args(["--kv-events"]).events and parse_args(["--kv-events"]).replicas == 1


def test_replicas_are_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--replicas", "0"])
    assert "--replicas" in capsys.readouterr().err


def test_the_replicas_config_file_is_one_the_router_accepts_with_the_model_s_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    options = StackOptions(replicas=2, cache_dir=tmp_path)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    options.model_dir.mkdir(parents=True)
    tokenizer.save(str(options.model_dir / "tokenizer.json"))
    write_router_config(options)
    workers = {"prefill": ["http://127.0.0.1:8100"], "decode": ["http://127.0.0.1:8200"]}
    settings = build_settings(yaml.safe_load(options.router_config_path.read_text()), workers)
    assert settings.decider == "session-affinity"
    assert settings.decider_options == {"tokenizer": str(options.model_dir)}
    write_router_config(dataclasses.replace(options, replicas=1, cache_dir=tmp_path / "one"))
    assert not (tmp_path / "one").exists()  # no KV events: the routers keep their flags alone
