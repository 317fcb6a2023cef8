"""A real router process whose decode pool comes from DNS: members join and leave while it serves."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from stack.procs import ManagedProcess, ProcessSpec, free_port
from tests.integration.discovery.dnsmasq import DOMAIN, Dnsmasq
from tests.integration.vllm_support import LOGS, REPO, wait_for

pytestmark = pytest.mark.integration


def process(name: str, argv: list[str], ready_url: str) -> ManagedProcess:
    proc = ManagedProcess(
        ProcessSpec(
            name=name,
            argv=tuple(argv),
            env=dict(os.environ),
            log_path=LOGS / f"{name}.log",
            ready_url=ready_url,
            cwd=REPO,
        )
    )
    proc.start()
    proc.wait_healthy(30.0)
    return proc


def fake(host: str, port: int) -> ManagedProcess:
    argv = [sys.executable, "-m", "tests.integration.router.fake_worker", "--host", host, "--port", str(port)]
    return process(f"fake-{host}-{port}", argv, f"http://{host}:{port}/health")


def decode_members(url: str) -> list[str]:
    workers = httpx.get(f"{url}/ready", timeout=5).json()["workers"]
    return sorted(w["url"] for w in workers if w["role"] == "decode" and w["healthy"])


def test_decode_workers_follow_dns_records(dnsmasq: Dnsmasq, tmp_path: Path) -> None:
    port = free_port()
    name = f"decode.{DOMAIN}"
    dnsmasq.set_records({"decode": ["127.0.0.2"]})
    workers = [fake("127.0.0.1", port), fake("127.0.0.2", port), fake("127.0.0.3", port)]
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "prefill": [f"http://127.0.0.1:{port},engine_id=fake,side_port=5600"],
                "decode": [],
                "discovery": {
                    "decode": {
                        "dns": {"name": name, "port": port, "interval": 0.3, "nameserver": f"127.0.0.1:{dnsmasq.port}"}
                    }
                },
            }
        )
    )
    router_port = free_port()
    router = process(
        "router-dns",
        [
            sys.executable,
            "-m",
            "router",
            "serve",
            "--config",
            str(config),
            "--port",
            str(router_port),
            "--health-interval",
            "0.3",
        ],
        f"http://127.0.0.1:{router_port}/health",
    )
    url = f"http://127.0.0.1:{router_port}"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    try:
        wait_for(lambda: decode_members(url) == [f"http://127.0.0.2:{port}"], "the first record is a member")
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=20).status_code == 200
        dnsmasq.set_records({"decode": ["127.0.0.3"]})
        wait_for(lambda: decode_members(url) == [f"http://127.0.0.3:{port}"], "the pool follows the new record")
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=20).status_code == 200
        dnsmasq.set_records({})
        wait_for(lambda: httpx.get(f"{url}/ready", timeout=5).status_code == 503, "no decode: not ready")
    finally:
        for proc in (router, *workers):
            proc.stop(5.0)
