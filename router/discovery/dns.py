"""DNS discovery: a service name's A/AAAA records, re-resolved on an interval, through a resolver seam."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import dns.asyncresolver
import dns.exception
import dns.resolver

from router.discovery.base import ErrorHook, MembershipSink, Publisher, specs_from_addresses
from router.domain import Role, Sleep
from router.errors import ConfigError

logger = logging.getLogger("kvpush.discovery")


class LookupFailed(Exception):
    """The name could not be resolved right now (timeout, SERVFAIL, refused): not the same as 'no such name'."""


class Resolver(Protocol):
    async def addresses(self, name: str) -> frozenset[str]:
        """Every A and AAAA address of `name`; empty when the name or its records do not exist.
        Raises LookupFailed when the answer is unknown."""
        ...


class DnspythonResolver:
    """Resolves with dnspython: the system's resolver (its search list and ndots apply, as for getaddrinfo;
    a name ending in '.' is absolute), or one given nameserver (an IP, with a port; names are absolute)."""

    def __init__(self, nameserver: str | None = None, port: int = 53, timeout: float = 2.0) -> None:
        self._search = nameserver is None
        if nameserver is None:
            try:
                self._resolver = dns.asyncresolver.Resolver(configure=True)
            except dns.resolver.NoResolverConfiguration as exc:
                raise ConfigError(f"DNS discovery: no system resolver configured ({exc}); give a nameserver") from exc
        else:
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [nameserver]
            self._resolver.port = port
        self._resolver.timeout = timeout
        self._resolver.lifetime = timeout

    async def addresses(self, name: str) -> frozenset[str]:
        v4, v6 = await asyncio.gather(self._query(name, "A"), self._query(name, "AAAA"))
        return v4 | v6

    async def _query(self, name: str, rdtype: str) -> frozenset[str]:
        try:
            answer = await self._resolver.resolve(name, rdtype, raise_on_no_answer=False, search=self._search)
        except dns.resolver.NXDOMAIN:
            return frozenset()
        except dns.exception.DNSException as exc:
            raise LookupFailed(f"{rdtype} {name}: {type(exc).__name__}: {exc}") from exc
        return frozenset(r.to_text() for r in answer.rrset) if answer.rrset is not None else frozenset()


class DnsSource:
    """One role's workers are the addresses of `name`, each on `port`. A failed lookup keeps the last set."""

    def __init__(
        self,
        role: Role,
        name: str,
        port: int,
        *,
        interval: float,
        timeout: float,
        resolver: Resolver,
        on_error: ErrorHook | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.role = role
        self.name = name
        self.port = port
        self.interval = interval
        self.timeout = timeout
        self.resolver = resolver
        self.errors = 0
        self._on_error = on_error
        self._sleep = sleep

    async def run(self, sink: MembershipSink) -> None:
        publisher = Publisher(self.role, sink)
        while True:
            await self.refresh(publisher)
            await self._sleep(self.interval)

    async def refresh(self, publisher: Publisher) -> None:
        """One round: resolve, then publish the new set if it changed. A failed round keeps the last set."""
        try:
            async with asyncio.timeout(self.timeout + 1.0):  # the resolver has its own deadline; this backs it
                addresses = await self.resolver.addresses(self.name)
            specs = specs_from_addresses(addresses, self.role, self.port)
            changed = publisher.publish(specs)
        except (LookupFailed, TimeoutError) as exc:
            self._failed(publisher, str(exc) or "timed out")
            return
        except Exception as exc:  # unexpected (a resolver or sink bug): this round fails, not the loop
            logger.exception("%s discovery: resolving %s raised", self.role, self.name)
            self._failed(publisher, f"{type(exc).__name__}: {exc}")
            return
        if changed:
            log = logger.info if specs else logger.warning
            log(
                "%s discovery: %s has %d address(es): %s",
                self.role,
                self.name,
                len(specs),
                " ".join(s.url for s in specs) or "none",
            )

    def _failed(self, publisher: Publisher, reason: str) -> None:
        kept = len(publisher.last or ())
        logger.warning(
            "%s discovery: resolving %s failed (%s); keeping %d known worker(s)", self.role, self.name, reason, kept
        )
        self.errors += 1
        if self._on_error is not None:
            self._on_error(self.role, reason)
