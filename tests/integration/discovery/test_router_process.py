"""A real router process whose decode pool comes from DNS: members join and leave while it serves."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import yaml

from stack.engines import Fleet, prefill_arg
from stack.procs import ManagedProcess, ProcessSpec, free_port
from stack.routers import Router, RouterSpec
from tests.integration.discovery.dnsmasq import DOMAIN, Dnsmasq
from tests.integration.support import INTEGRATION, LOGS, REPO, wait_for

pytestmark = INTEGRATION


def fake(host: str, port: int) -> ManagedProcess:
    """A stand-in worker on host:port (any loopback address: one DNS record each)."""
    argv = (sys.executable, "-m", "tests.integration.router.fake_worker", "--host", host, "--port", str(port))
    name = f"fake-{host}-{port}"
    return ManagedProcess(
        ProcessSpec(name, argv, dict(os.environ), LOGS / f"{name}.log", f"http://{host}:{port}/health", REPO)
    )


def decode_members(url: str) -> list[str]:
    workers = httpx.get(f"{url}/ready", timeout=5).json()["workers"]
    return sorted(w["url"] for w in workers if w["role"] == "decode" and w["healthy"])


def test_decode_workers_follow_dns_records(dnsmasq: Dnsmasq, tmp_path: Path) -> None:
    port = free_port()
    name = f"decode.{DOMAIN}"
    dnsmasq.set_records({"decode": ["127.0.0.2"]})
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "prefill": [prefill_arg(f"http://127.0.0.1:{port}", "fake", 5600)],
                "decode": [],
                "discovery": {
                    "decode": {
                        "dns": {"name": name, "port": port, "interval": 0.3, "nameserver": f"127.0.0.1:{dnsmasq.port}"}
                    }
                },
            }
        )
    )
    spec = RouterSpec(name="router-dns", config=config, flags=("--health-interval", "0.3"), ready_path="/health")
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    with Fleet(LOGS, stop_grace=5.0) as fleet:
        for host in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
            fleet.start(fake(host, port))
        url = fleet.start(Router(spec, log_dir=LOGS)).url
        fleet.wait_all_healthy(30.0)
        wait_for(lambda: decode_members(url) == [f"http://127.0.0.2:{port}"], "the first record is a member")
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=20).status_code == 200
        dnsmasq.set_records({"decode": ["127.0.0.3"]})
        wait_for(lambda: decode_members(url) == [f"http://127.0.0.3:{port}"], "the pool follows the new record")
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=20).status_code == 200
        dnsmasq.set_records({})
        wait_for(lambda: httpx.get(f"{url}/ready", timeout=5).status_code == 503, "no decode: not ready")
