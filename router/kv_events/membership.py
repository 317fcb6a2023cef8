"""Which publishers the subscriber should follow, from the pool's members. Pure.

Every worker of a role in `kv_events.roles` publishes: its endpoints come from its URL and the `kv_events:` block
(router/kv_events/settings.py: a fixed port per host, or offsets from the worker's HTTP port; its own `dp=N`
ranks). `plan` compares that with what the subscriber follows now and says what to add and whom to drop; the
service runs it when the pool changes (admin API, discovery) and once a health interval.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from router.domain import WorkerSpec
from router.errors import ConfigError
from router.kv_events.endpoints import RankPublisher
from router.kv_events.settings import KvEventSettings


@dataclass(frozen=True)
class Plan:
    add: tuple[RankPublisher, ...]  # publishers to follow (new workers, or ones whose endpoints changed)
    remove: tuple[str, ...]  # workers to drop (they left the pool, or no longer publish)
    refused: tuple[str, ...] = ()  # workers whose endpoints cannot be derived (their URL), with the reason


def wanted(
    settings: KvEventSettings, members: Iterable[WorkerSpec]
) -> tuple[dict[str, list[RankPublisher]], list[str]]:
    """Per publishing worker, its endpoints (every rank); and the workers refused, with why."""
    found: dict[str, list[RankPublisher]] = {}
    refused = []
    for spec in members:
        if spec.role not in settings.roles:
            continue
        try:
            found[spec.id] = settings.endpoints(spec.id, spec.url, spec.dp_size)
        except ConfigError as bad:
            refused.append(f"{spec.id}: {bad}")
    return found, refused


def plan(
    settings: KvEventSettings, members: Iterable[WorkerSpec], following: Mapping[str, Sequence[RankPublisher]]
) -> Plan:
    """What to change so the subscriber follows exactly the publishing members (`following`: per worker, the
    endpoints followed now)."""
    want, refused = wanted(settings, members)
    add = [e for worker, endpoints in want.items() if list(following.get(worker, ())) != endpoints for e in endpoints]
    remove = [worker for worker in following if worker not in want]
    stale = [w for w, endpoints in want.items() if w in following and len(following[w]) > len(endpoints)]
    return Plan(tuple(add), tuple(sorted({*remove, *stale})), tuple(refused))
