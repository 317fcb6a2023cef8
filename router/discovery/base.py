"""The discovery contracts (sink, source), the static source and the pure address → worker decisions."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.domain import Role, WorkerSpec


class MembershipSink(Protocol):
    """Receives one role's whole membership on every change (the router's Pool)."""

    def set_members(self, role: Role, specs: Sequence[WorkerSpec]) -> None: ...


class Source(Protocol):
    """Keeps one role's membership current. `run` lasts until cancelled and calls the sink on every change; a
    failed round keeps the last membership. Until the first one is published the role's pool is empty, so the
    router is not ready: that is how readiness waits for discovery."""

    role: Role

    async def run(self, sink: MembershipSink) -> None: ...


class ErrorHook(Protocol):
    """Told of each failed discovery round (the membership is kept as it was): wire it to a counter."""

    def __call__(self, role: Role, reason: str) -> None: ...


def host_for_url(host: str) -> str:
    """An address or name as it goes in a URL: IPv6 literals in brackets."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def worker_url(host: str, port: int) -> str:
    return f"http://{host_for_url(host)}:{port}"


def _address_key(address: str) -> tuple[int, int]:
    ip = ipaddress.ip_address(address)
    return ip.version, int(ip)


def specs_from_addresses(addresses: Iterable[str], role: Role, port: int) -> list[WorkerSpec]:
    """Each distinct address → one worker on `port`, in address order. Prefill identities are learned."""
    unique = {str(ipaddress.ip_address(a)) for a in addresses}
    return [WorkerSpec(url=worker_url(a, port), role=role) for a in sorted(unique, key=_address_key)]


@dataclass
class Publisher:
    """Calls the sink only when the membership differs from what it last published."""

    role: Role
    sink: MembershipSink
    last: tuple[WorkerSpec, ...] | None = None

    def publish(self, specs: Sequence[WorkerSpec]) -> bool:
        current = tuple(specs)
        if current == self.last:
            return False
        self.sink.set_members(self.role, current)
        self.last = current
        return True


class StaticSource:
    """A fixed list, published once; then idles until cancelled so every source runs the same way."""

    def __init__(self, role: Role, specs: Sequence[WorkerSpec]) -> None:
        self.role = role
        self.specs = tuple(specs)

    async def run(self, sink: MembershipSink) -> None:
        sink.set_members(self.role, self.specs)
        await asyncio.get_running_loop().create_future()  # never done: returns only by cancellation


class Backoff:
    """Doubling delays between failed attempts, capped; `reset` after a success."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.maximum, self._next * 2)
        return delay

    def reset(self) -> None:
        self._next = self.initial
