"""DNS discovery against a real dnsmasq on loopback whose records change while the source runs."""

from __future__ import annotations

import asyncio

import pytest

from router.discovery.build import build_source
from router.discovery.dns import DnspythonResolver, DnsSource, LookupFailed
from router.discovery.settings import parse_discovery
from router.domain import Role
from tests.integration.discovery.dnsmasq import DOMAIN, Dnsmasq
from tests.integration.discovery.recording import RecordingSink, until

pytestmark = pytest.mark.integration


async def test_the_resolver_reads_a_and_aaaa_and_tells_no_such_name_from_failure(dnsmasq: Dnsmasq) -> None:
    dnsmasq.set_records({"prefill": ["127.0.0.11", "127.0.0.12", "::1"]})
    resolver = DnspythonResolver("127.0.0.1", dnsmasq.port, timeout=2.0)
    assert await _eventually(resolver, f"prefill.{DOMAIN}", {"127.0.0.11", "127.0.0.12", "::1"})
    assert await resolver.addresses(f"nobody.{DOMAIN}") == frozenset()  # NXDOMAIN: no workers
    with pytest.raises(LookupFailed, match="REFUSED"):  # outside the served domain: the answer is unknown
        await resolver.addresses("prefill.elsewhere.example")


async def _eventually(resolver: DnspythonResolver, name: str, wanted: set[str]) -> bool:
    for _ in range(100):
        if await resolver.addresses(name) == wanted:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_membership_follows_the_records_and_survives_an_unreachable_resolver(dnsmasq: Dnsmasq) -> None:
    dnsmasq.set_records({"decode": ["127.0.0.21", "127.0.0.22"], "prefill": ["127.0.0.11"]})
    (cfg,) = parse_discovery(
        {
            "decode": {
                "dns": {
                    "name": f"decode.{DOMAIN}",
                    "port": 8200,
                    "interval": 0.1,
                    "timeout": 0.3,
                    "nameserver": f"127.0.0.1:{dnsmasq.port}",
                }
            }
        }
    )
    errors: list[str] = []
    source = build_source(cfg, on_error=lambda role, reason: errors.append(reason))
    assert isinstance(source, DnsSource)
    sink = RecordingSink()
    task = asyncio.create_task(source.run(sink))
    try:
        await until(lambda: sink.urls == ["http://127.0.0.21:8200", "http://127.0.0.22:8200"], "the first two")

        dnsmasq.set_records({"decode": ["127.0.0.22", "127.0.0.23", "::1"]})  # one replaced, an IPv6 one added
        await until(
            lambda: sink.urls == ["http://127.0.0.22:8200", "http://127.0.0.23:8200", "http://[::1]:8200"],
            "the changed set",
        )

        dnsmasq.pause()  # the resolver stops answering: lookups time out
        await until(lambda: len(errors) >= 2, "failed lookups to be counted")
        assert sink.urls == ["http://127.0.0.22:8200", "http://127.0.0.23:8200", "http://[::1]:8200"]
        dnsmasq.set_records({"decode": ["127.0.0.24"]}, wait=False)  # read once the server runs again
        dnsmasq.resume()
        await until(lambda: sink.urls == ["http://127.0.0.24:8200"], "the set after the resolver came back")

        dnsmasq.set_records({"prefill": ["127.0.0.11"]})  # the decode name is gone
        await until(lambda: sink.urls == [], "an empty pool once the name has no records")
        dnsmasq.set_records({"decode": ["127.0.0.25"]})
        await until(lambda: sink.urls == ["http://127.0.0.25:8200"], "a worker again")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert all(role is Role.DECODE for role, _ in sink.history)
    assert [] not in sink.seen()[:-2]  # never emptied by the failed lookups; only when the name had no records
    assert all(a != b for a, b in zip(sink.seen(), sink.seen()[1:], strict=False))  # published on change only
