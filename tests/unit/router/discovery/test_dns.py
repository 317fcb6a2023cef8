"""The DNS source driven without sockets through a scripted resolver: changes only, failures keep the set."""

from __future__ import annotations

import asyncio

import pytest

from router.discovery.build import build_source
from router.discovery.dns import DnsSource, LookupFailed
from router.discovery.settings import DnsConfig
from router.domain import Role, WorkerSpec
from router.metrics import Metrics
from router.workers.pool import Pool
from tests.unit.router.discovery.support import ScriptedResolver, Sink, Sleeps, Stop


async def test_dns_source_publishes_changes_only_and_keeps_the_last_set_when_lookups_fail() -> None:
    resolver = ScriptedResolver(
        frozenset({"10.0.0.2", "10.0.0.1"}),
        frozenset({"10.0.0.1", "10.0.0.2"}),
        LookupFailed("SERVFAIL"),
        frozenset({"10.0.0.1"}),
        frozenset(),
        frozenset({"fd00::1"}),
    )
    errors: list[tuple[Role, str]] = []
    sleeps = Sleeps(rounds=6)
    source = DnsSource(
        Role.DECODE,
        "d.test",
        8000,
        interval=3.0,
        timeout=1.0,
        resolver=resolver,
        on_error=lambda role, reason: errors.append((role, reason)),
        sleep=sleeps,
    )
    sink = Sink()
    with pytest.raises(Stop):
        await source.run(sink)
    assert sink.urls == [
        ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
        ["http://10.0.0.1:8000"],  # the failed lookup in between changed nothing
        [],  # no records: an empty pool
        ["http://[fd00::1]:8000"],
    ]
    assert all(role is Role.DECODE for role, _ in sink.calls)
    assert errors == [(Role.DECODE, "SERVFAIL")] and source.errors == 1
    assert sleeps.delays == [3.0] * 6


async def test_dns_source_counts_a_resolver_that_hangs_past_its_deadline() -> None:
    class Hangs:
        async def addresses(self, name: str) -> frozenset[str]:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    source = DnsSource(Role.PREFILL, "p.test", 1, interval=1.0, timeout=0.01, resolver=Hangs(), sleep=Sleeps(1))
    sink = Sink()
    with pytest.raises(Stop):
        await source.run(sink)
    assert source.errors == 1 and sink.calls == []


async def test_dns_source_survives_an_unexpected_error_and_keeps_the_last_set() -> None:
    resolver = ScriptedResolver(
        frozenset({"10.0.0.1"}),
        ValueError("a resolver bug"),
        frozenset({"not-an-address"}),  # a resolver that answers nonsense
        frozenset({"10.0.0.2"}),
    )
    errors: list[tuple[Role, str]] = []
    source = DnsSource(
        Role.DECODE,
        "d.test",
        8000,
        interval=1.0,
        timeout=1.0,
        resolver=resolver,
        on_error=lambda role, reason: errors.append((role, reason)),
        sleep=Sleeps(rounds=4),
    )
    sink = Sink()
    with pytest.raises(Stop):
        await source.run(sink)
    assert sink.urls == [["http://10.0.0.1:8000"], ["http://10.0.0.2:8000"]]
    assert [reason.split(":")[0] for _, reason in errors] == ["ValueError", "ValueError"] and source.errors == 2


def test_a_dns_config_builds_a_dns_source_with_the_given_nameserver() -> None:
    source = build_source(DnsConfig(Role.PREFILL, "p.test", 8100, nameserver="127.0.0.1", nameserver_port=5353))
    assert isinstance(source, DnsSource) and (source.name, source.port) == ("p.test", 8100)


async def test_the_routers_pool_is_a_membership_sink() -> None:
    pool = Pool(
        [WorkerSpec("http://10.9.9.9:8000", Role.DECODE), WorkerSpec("http://10.0.0.5:8100", Role.PREFILL)], Metrics()
    )
    resolver = ScriptedResolver(frozenset({"10.0.0.1", "10.0.0.2"}))
    source = DnsSource(Role.DECODE, "d.test", 8000, interval=1.0, timeout=1.0, resolver=resolver, sleep=Sleeps(1))
    with pytest.raises(Stop):
        await source.run(pool)
    assert [s.url for s in pool.members(Role.DECODE)] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert [s.url for s in pool.members(Role.PREFILL)] == ["http://10.0.0.5:8100"]  # the other role is untouched
