"""Kubernetes discovery configured as in a pod: API address from the environment, token, namespace and CA from
service-account files, over TLS to the stand-in API; the token file is re-read (rotated) between calls."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from router.discovery.build import build_source
from router.discovery.kubernetes import KubernetesSource
from router.discovery.settings import parse_discovery
from tests.integration.discovery.kube_standin import KubeStandin, make_pod
from tests.integration.discovery.recording import RecordingSink, until

pytestmark = pytest.mark.integration

DECODE = {"app": "vllm", "kvpush.io/role": "decode"}


def self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with the openssl command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make a test certificate")
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            f"/CN={name}",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def service_account(folder: Path, token: str, ca: Path) -> Path:
    folder.mkdir()
    (folder / "token").write_text(token)
    (folder / "namespace").write_text("llm\n")
    shutil.copy(ca, folder / "ca.crt")
    return folder


def in_cluster_source(account: Path, api_url: str, errors: list[str]) -> KubernetesSource:
    (cfg,) = parse_discovery(
        {
            "decode": {
                "kubernetes": {
                    "selector": "app=vllm,kvpush.io/role=decode",
                    "port": 8000,
                    "token_path": str(account / "token"),
                    "ca_path": str(account / "ca.crt"),
                    "request_timeout": 5,
                    "backoff_max": 0.5,
                }
            }
        }
    )
    host_port = api_url.removeprefix("https://")
    env = {"KUBERNETES_SERVICE_HOST": host_port.split(":")[0], "KUBERNETES_SERVICE_PORT": host_port.split(":")[1]}
    source = build_source(cfg, env=env, on_error=lambda role, reason: errors.append(reason))
    assert isinstance(source, KubernetesSource)
    return source


async def test_in_cluster_settings_over_tls_with_a_rotating_token(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path, "apiserver")
    kube = KubeStandin()
    await kube.start(certfile=str(cert), keyfile=str(key))
    account = service_account(tmp_path / "sa", kube.token, cert)
    await kube.apply(make_pod("d0", "127.0.3.1", ready=True, labels=DECODE))
    errors: list[str] = []
    sink = RecordingSink()
    task = asyncio.create_task(in_cluster_source(account, kube.url, errors).run(sink))
    try:
        await until(lambda: sink.urls == ["http://127.0.3.1:8000"], "the pod, listed over TLS")
        kube.token = "rotated-token"  # the kubelet rotates the projected token file
        (account / "token").write_text("rotated-token")
        await kube.apply(make_pod("d1", "127.0.3.2", ready=True, labels=DECODE))
        await kube.expire_watches()
        await until(lambda: sink.urls == ["http://127.0.3.1:8000", "http://127.0.3.2:8000"], "d1 after rotation")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube.stop()
    assert errors == []


async def test_an_api_server_the_ca_does_not_vouch_for_is_refused(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path, "apiserver")
    other_ca, _ = self_signed(tmp_path, "someone-else")
    kube = KubeStandin()
    await kube.start(certfile=str(cert), keyfile=str(key))
    account = service_account(tmp_path / "sa", kube.token, other_ca)
    await kube.apply(make_pod("d0", "127.0.3.1", ready=True, labels=DECODE))
    errors: list[str] = []
    sink = RecordingSink()
    task = asyncio.create_task(in_cluster_source(account, kube.url, errors).run(sink))
    try:
        await until(lambda: len(errors) >= 2, "refused connections to be counted")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube.stop()
    assert sink.history == [] and kube.requests == []
    assert "CERTIFICATE_VERIFY_FAILED" in errors[0]
