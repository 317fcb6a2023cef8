"""Fixtures for discovery against real servers on loopback: a dnsmasq whose records the test rewrites, and the
stand-in Kubernetes API. The dnsmasq tests skip, saying how to install it, when no dnsmasq binary is found."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.integration.discovery.dnsmasq import Dnsmasq, dnsmasq_binary
from tests.integration.discovery.kube_standin import KubeStandin


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    binary = dnsmasq_binary()
    if binary is None:
        pytest.skip("no dnsmasq binary found; install it with: apt-get install -y dnsmasq-base")
    server = Dnsmasq(binary, tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def kube() -> AsyncIterator[KubeStandin]:
    server = KubeStandin()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
