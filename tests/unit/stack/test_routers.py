"""stack.routers without processes: the router spec, its exact command (read back by the router's own flag
parser), its environment and process description, and port resolution."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from router.cli import load_serve_settings
from stack.engines import EngineSpec, resolve_ports
from stack.family import pd_family
from stack.routers import Router, RouterSpec, router_argv, router_env, router_process, router_spec

MODEL = Path("/models/tiny")


def family_specs() -> tuple[EngineSpec, EngineSpec]:
    family = pd_family("t", MODEL, "NixlPushConnector")
    prefill, decode = family.prefills[0], family.decode
    ports = itertools.count(41000)
    return resolve_ports(prefill, ports.__next__), resolve_ports(decode, ports.__next__)


def test_the_command_is_exact_and_in_order() -> None:
    spec = RouterSpec(
        port=8000,
        mode="push",
        prefills=("http://127.0.0.1:8100,engine_id=p,side_port=5600",),
        decodes=("http://127.0.0.1:8200", "http://127.0.0.1:8201"),
        config=Path("/etc/router.yaml"),
        flags=("--health-interval", "0.5"),
    )
    assert router_argv(spec, python="py") == (
        "py",
        "-m",
        "router",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--config",
        "/etc/router.yaml",
        "--mode",
        "push",
        "--prefill",
        "http://127.0.0.1:8100,engine_id=p,side_port=5600",
        "--decode",
        "http://127.0.0.1:8200",
        "--decode",
        "http://127.0.0.1:8201",
        "--health-interval",
        "0.5",
    )


def test_no_mode_and_no_workers_leave_them_to_the_router() -> None:
    assert router_argv(RouterSpec(port=9), python="py") == (
        "py",
        "-m",
        "router",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "9",
    )


def test_the_router_s_own_parser_reads_the_command_back_with_the_prefill_identity() -> None:
    prefill, decode = family_specs()
    spec = router_spec(8123, "pull", [prefill], [decode], "--retries", "2")
    settings = load_serve_settings(list(router_argv(spec)[4:]), {})
    assert (settings.host, settings.port, str(settings.mode), settings.retries) == ("127.0.0.1", 8123, "pull", 2)
    (worker,) = settings.prefill
    assert worker.url == prefill.url
    assert worker.identity is not None
    assert (worker.identity.engine_id, worker.identity.host, worker.identity.port) == (
        "t-p0",
        "127.0.0.1",
        prefill.side_port,
    )
    assert [w.url for w in settings.decode] == [decode.url]


def test_workers_may_be_given_as_strings_or_engine_specs() -> None:
    prefill, decode = family_specs()
    spec = router_spec(1, None, [prefill, "http://p:1"], [decode, "http://d:2"], name="r")
    assert spec.prefills == (prefill.prefill_arg(), "http://p:1")
    assert spec.decodes == (decode.url, "http://d:2")
    assert spec.name == "r"


def test_the_command_needs_a_resolved_port() -> None:
    with pytest.raises(ValueError, match="resolve the port"):
        router_argv(RouterSpec())


@pytest.mark.parametrize(("fields", "fragment"), [({"port": 70000}, "TCP port"), ({"ready_path": "ready"}, "'/'")])
def test_invalid_specs_are_refused(fields: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        RouterSpec(**fields)  # type: ignore[arg-type]


def test_the_environment_puts_the_repository_first_and_keeps_the_rest() -> None:
    spec = RouterSpec(env={"KVPUSH_LOG_LEVEL": "debug"})
    env = router_env(spec, {"PATH": "/bin", "PYTHONPATH": "/x"}, repo_root=Path("/repo"))
    assert env == {"PATH": "/bin", "PYTHONPATH": "/repo:/x", "KVPUSH_LOG_LEVEL": "debug"}
    assert router_env(RouterSpec(), {}, repo_root=Path("/repo"))["PYTHONPATH"] == "/repo"


def test_the_process_logs_by_name_waits_for_ready_and_finds_the_repository() -> None:
    proc = router_process(RouterSpec(name="front", port=8124), Path("/logs"), python="py", base_env={})
    assert proc.log_path == Path("/logs/front.log")
    assert proc.ready_url == "http://127.0.0.1:8124/ready"
    assert (Path(proc.env["PYTHONPATH"]) / "router").is_dir()
    assert proc.cwd is not None and (proc.cwd / "router").is_dir()
    health = router_process(RouterSpec(port=8124, ready_path="/health"), Path("/logs"), base_env={})
    assert health.ready_url == "http://127.0.0.1:8124/health"


def test_a_router_handle_picks_a_free_port_once_and_keeps_a_given_one() -> None:
    picked = Router(RouterSpec(), log_dir=Path("/logs"), pick_port=lambda: 41234, base_env={})
    assert (picked.port, picked.url) == (41234, "http://127.0.0.1:41234")
    assert "41234" in picked.spec.argv
    given = Router(RouterSpec(port=8000), log_dir=Path("/logs"), pick_port=lambda: 1, base_env={})
    assert given.port == 8000


def test_a_wrapper_module_may_run_the_router() -> None:
    spec = router_spec(9, "push", [], [], runner=("-m", "loadtest.profiled", "/tmp/r.prof"))
    assert router_argv(spec, python="py")[:6] == ("py", "-m", "loadtest.profiled", "/tmp/r.prof", "router", "serve")
