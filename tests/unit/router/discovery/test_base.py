"""The static source: published once, then idle until cancelled like every source."""

from __future__ import annotations

import asyncio

import pytest

from router.discovery.base import StaticSource
from router.discovery.build import build_source
from router.discovery.settings import StaticConfig
from router.domain import Role, WorkerSpec
from tests.unit.router.discovery.support import Sink


async def test_static_source_publishes_once_and_runs_until_cancelled() -> None:
    spec = WorkerSpec("http://10.0.0.1:1", Role.DECODE)
    source = build_source(StaticConfig(Role.DECODE, (spec,)))
    assert isinstance(source, StaticSource)
    sink = Sink()
    task = asyncio.create_task(source.run(sink))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert sink.calls == [(Role.DECODE, ["http://10.0.0.1:1"])] and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
