"""Discovery settings: the YAML block parsed into typed configs; every mistake refused with a clear message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.discovery.settings import (
    Discovery,
    DnsConfig,
    KubernetesConfig,
    StaticConfig,
    parse_discovery,
    resolve_in_cluster,
)
from router.domain import NixlIdentity, Role, WorkerSpec
from router.errors import ConfigError

EXAMPLE = """
discovery:
  prefill: {dns: {name: prefill.ns.svc.cluster.local, port: 8000, interval: 5, nameserver: "10.0.0.10:53"}}
  decode:  {kubernetes: {namespace: llm, selector: "app=vllm,kvpush.io/role=decode", port: 8000}}
"""


def test_the_documented_example_parses_into_one_config_per_role() -> None:
    prefill, decode = parse_discovery(yaml.safe_load(EXAMPLE)["discovery"])
    assert prefill == DnsConfig(
        role=Role.PREFILL,
        name="prefill.ns.svc.cluster.local",
        port=8000,
        interval=5.0,
        nameserver="10.0.0.10",
        nameserver_port=53,
    )
    assert decode == KubernetesConfig(
        role=Role.DECODE, selector="app=vllm,kvpush.io/role=decode", port=8000, namespace="llm"
    )


def test_kubernetes_defaults_are_in_cluster() -> None:
    (cfg,) = parse_discovery({"decode": {"kubernetes": {"selector": "app=d", "port": 80}}})
    assert isinstance(cfg, KubernetesConfig)
    assert (cfg.namespace, cfg.api_url, cfg.token, cfg.insecure) == (None, None, None, False)
    assert cfg.token_path == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert cfg.ca_path == "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


def test_kubernetes_overrides_for_tests() -> None:
    (cfg,) = parse_discovery(
        {
            "prefill": {
                "kubernetes": {
                    "selector": "app=p",
                    "port": 80,
                    "namespace": "x",
                    "api_url": "http://127.0.0.1:9/",
                    "token": "t",
                    "ca_path": None,
                    "insecure": True,
                    "watch_timeout": 2.5,
                    "request_timeout": 1,
                    "backoff_max": 3,
                }
            }
        }
    )
    assert isinstance(cfg, KubernetesConfig)
    assert (cfg.api_url, cfg.token, cfg.ca_path, cfg.insecure) == ("http://127.0.0.1:9", "t", None, True)
    assert (cfg.watch_timeout, cfg.request_timeout, cfg.backoff_max) == (3, 1.0, 3.0)


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("10.0.0.10", "10.0.0.10", 53),
        ("127.0.0.1:5353", "127.0.0.1", 5353),
        ("[fd00::a]:5300", "fd00::a", 5300),
        ("fd00::a", "fd00::a", 53),
    ],
)
def test_nameserver_forms(text: str, host: str, port: int) -> None:
    (cfg,) = parse_discovery({"decode": {"dns": {"name": "d.example", "port": 1, "nameserver": text}}})
    assert isinstance(cfg, DnsConfig)
    assert (cfg.nameserver, cfg.nameserver_port) == (host, port)


def test_without_a_nameserver_the_system_resolver_is_used() -> None:
    (cfg,) = parse_discovery({"decode": {"dns": {"name": "d.example", "port": 1}}})
    assert isinstance(cfg, DnsConfig) and cfg.nameserver is None


def test_static_lists_reuse_the_worker_syntax_including_prefill_identities() -> None:
    prefill, decode = parse_discovery(
        {
            "prefill": {"static": ["http://10.0.0.1:8100,engine_id=p0,side_port=5600", "http://10.0.0.2:8100"]},
            "decode": {"static": ["http://10.0.1.1:8200/"]},
        }
    )
    assert prefill == StaticConfig(
        Role.PREFILL,
        (
            WorkerSpec("http://10.0.0.1:8100", Role.PREFILL, NixlIdentity("p0", "10.0.0.1", 5600)),
            WorkerSpec("http://10.0.0.2:8100", Role.PREFILL),
        ),
    )
    assert decode == StaticConfig(Role.DECODE, (WorkerSpec("http://10.0.1.1:8200", Role.DECODE),))


def test_an_empty_block_means_no_discovery() -> None:
    assert parse_discovery({}) == Discovery() and list(parse_discovery({})) == [] and not parse_discovery({})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "expected a mapping of role"),
        ({"encode": {"dns": {}}}, "unknown role"),
        ({"decode": {"dns": {}, "kubernetes": {}}}, "exactly one of"),
        ({"decode": {"consul": {}}}, "exactly one of"),
        ({"decode": {"dns": "d.example"}}, "expected a mapping of options"),
        ({"decode": {"dns": {"port": 1}}}, r"discovery\.decode\.dns: name"),
        ({"decode": {"dns": {"name": "d"}}}, r"discovery\.decode\.dns\.port: the port is missing"),
        ({"decode": {"dns": {"name": "d", "port": 0}}}, "out of range"),
        ({"decode": {"dns": {"name": "d", "port": "http"}}}, "expected a port number"),
        (
            {"decode": {"dns": {"name": "d", "port": 1, "interval": 0}}},
            r"interval: must be a positive, finite",
        ),
        ({"decode": {"dns": {"name": "d", "port": 1, "interval": "soon"}}}, "number of seconds"),
        ({"decode": {"dns": {"name": "d", "port": 1, "nameserver": "dns.google"}}}, "not an IP address"),
        ({"decode": {"dns": {"name": "d", "port": 1, "nameserver": "1.1.1.1:99999"}}}, "out of range"),
        ({"decode": {"dns": {"name": "d", "port": 1, "ttl": 3}}}, r"unknown option\(s\) \['ttl'\]"),
        ({"decode": {"kubernetes": {"port": 1}}}, "selector"),
        ({"decode": {"kubernetes": {"selector": " ", "port": 1}}}, "selector"),
        ({"decode": {"kubernetes": {"selector": "a=b", "port": 1, "api_url": "kube:6443"}}}, "api_url"),
        ({"decode": {"kubernetes": {"selector": "a=b", "port": 1, "insecure": "yes"}}}, "true or false"),
        ({"decode": {"kubernetes": {"selector": "a=b", "port": 1, "namespace": ""}}}, "non-empty string"),
        ({"decode": {"kubernetes": {"selector": "a=b", "port": 1, "labels": "x"}}}, "unknown option"),
        ({"decode": {"kubernetes": {"selector": "a=b", "port": 1, "token": 12345}}}, r"token: .* got int$"),
        ({"decode": {"kubernetes": {"token": "s3cret"}, "dns": {}}}, r"got keys \['dns', 'kubernetes'\]$"),
        ({"decode": {"static": "http://d:1"}}, "list of worker URLs"),
        ({"decode": {"static": ["d:1"]}}, "not a base URL"),
        ({"prefill": {"static": ["http://p:1,engine_id=p0"]}}, "side_port"),
    ],
)
def test_mistakes_are_refused_with_a_clear_message(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_discovery(raw)


@pytest.mark.parametrize(
    "module", ["router.discovery.settings", "router.discovery.pods", "router.discovery.base", "router.policy"]
)
def test_the_pure_discovery_modules_load_no_io_library(module: str) -> None:
    code = f"import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = {name.split(".")[0] for name in json.loads(out.stdout)}
    assert not loaded & {"httpx", "dns", "uvicorn", "prometheus_client", "fastapi"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"decode": {"dns": {"name": "d", "port": True}}}, "expected a port number"),
        ({"decode": {"dns": {"name": "d", "port": 1, "timeout": True}}}, "number of seconds"),
        ({"decode": {"dns": {"name": "d", "port": 1, "interval": "inf"}}}, "finite"),
        ({"decode": {"kubernetes": {"selector": "a=b", "port": 1, "watch_timeout": 0}}}, "watch_timeout"),
        ({"decode": {"kubernetes": {"selector": "a=b", "port": 1, "api_url": "https://u:pw@k:6443"}}}, "credentials"),
        ({"decode": {"static": ["http://u:pw@d:1"]}}, "credentials"),
        ({"decode": {"static": ["http://d:1", "http://d:1/"]}}, "listed twice"),
        ({"decode": {"static": [{"url": "http://d:1", "engine_id": "e"}]}}, "unknown option"),
    ],
)
def test_discovery_values_follow_the_same_rules_as_every_other_setting(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_discovery(raw)


def test_static_workers_may_be_https_or_typed_fields_like_the_static_settings() -> None:
    prefill, decode = parse_discovery(
        {
            "prefill": {"static": [{"url": "https://p:1", "engine_id": "p0", "side_port": 5600}]},
            "decode": {"static": ["https://d:1"]},
        }
    )
    assert prefill == StaticConfig(
        Role.PREFILL, (WorkerSpec("https://p:1", Role.PREFILL, NixlIdentity("p0", "p", 5600)),)
    )
    assert decode == StaticConfig(Role.DECODE, (WorkerSpec("https://d:1", Role.DECODE),))


def test_the_parsed_block_says_which_roles_it_covers_and_parses_once() -> None:
    block = parse_discovery({"decode": {"dns": {"name": "d.example", "port": 1}}})
    assert Role.DECODE in block and "decode" in block and "prefill" not in block and len(block) == 1
    assert isinstance(block.source(Role.DECODE), DnsConfig) and block.source(Role.PREFILL) is None
    assert parse_discovery(block) is block, "an already parsed block is not parsed again"


def test_in_cluster_defaults_are_resolved_from_the_environment(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "namespace").write_text("llm\n")
    (tmp_path / "ca.crt").write_text("not checked here, only that it exists\n")
    account = {"token_path": str(tmp_path / "token"), "ca_path": str(tmp_path / "ca.crt")}
    block = parse_discovery(
        {
            "prefill": {"dns": {"name": "p.example", "port": 1}},
            "decode": {"kubernetes": {"selector": "a=b", "port": 1, **account}},
        }
    )
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
    dns, kube = resolve_in_cluster(block, env)
    assert dns == block.source(Role.PREFILL)
    assert isinstance(kube, KubernetesConfig)
    assert (kube.api_url, kube.namespace) == ("https://10.96.0.1:6443", "llm")
    given = parse_discovery(
        {"decode": {"kubernetes": {"selector": "a=b", "port": 1, "namespace": "x", "api_url": "http://k:1"}}}
    )
    assert resolve_in_cluster(given, {}) == given, "given settings win and need no environment"


@pytest.mark.parametrize(
    ("options", "env", "message"),
    [
        ({}, {}, "KUBERNETES_SERVICE_HOST is unset"),
        ({}, {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "x"}, "KUBERNETES_SERVICE_PORT"),
        ({"ca_path": "/nonexistent/ca.crt"}, {"KUBERNETES_SERVICE_HOST": "h"}, r"CA file /nonexistent/ca\.crt"),
        ({"insecure": True, "token_path": "/nonexistent/token"}, {"KUBERNETES_SERVICE_HOST": "h"}, "namespace"),
    ],
)
def test_a_missing_in_cluster_default_is_a_config_error(options: Any, env: Any, message: str) -> None:
    block = parse_discovery({"decode": {"kubernetes": {"selector": "a=b", "port": 1, **options}}})
    with pytest.raises(ConfigError, match=message):
        resolve_in_cluster(block, env)


def test_discovery_settings_do_not_import_the_router_settings() -> None:
    code = "import sys, router.discovery.settings; print('router.config' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False", "router.config imports discovery settings, never the other way round"
