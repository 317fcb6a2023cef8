"""The `kv_events:` block: whether the router subscribes to its engines' KV events, where they publish, the
bounds. Pure.

    kv_events:
      enabled: true
      roles: [prefill, decode]      # the pools whose engines publish (default: both)
      port: 5557                    # rank 0's publisher port on each worker's host (the engine binds tcp://*:5557)
      replay_port: 5558             # rank 0's replay port; null: the engines have none (a gap is then a hole)
      # or, for several engines on one host (the local stack, the tests), ports relative to each worker's HTTP port:
      # port_offset: 1000           # rank 0 publishes on <HTTP port> + 1000 (instead of port / replay_port)
      # replay_offset: 2000         # its replay socket on <HTTP port> + 2000; absent: no replay
      topic: kv                     # the engines' `topic` ("" by default)
      dp_size: 1                    # data-parallel ranks per engine (rank r on port + r); a worker's own
                                    # dp=N (its SPEC) wins
      max_blocks_per_stream: 200000 # per worker and rank (~300 B a block)
      max_frame_bytes: 4194304      # one batch's payload; larger ones are counted and skipped
      replay_timeout: 2             # seconds, one whole replay
      max_held: 1024                # live batches held while a replay runs

The engines must be started with the matching `--kv-events-config` (`engine_config` builds it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router import values
from router.domain import Role
from router.errors import ConfigError
from router.kv_events.endpoints import RankPublisher, endpoints_near, url_port
from router.kv_events.stream import StreamLimits, SubscriberLimits


@dataclass(frozen=True)
class KvEventSettings:
    enabled: bool = False
    roles: tuple[Role, ...] = (Role.PREFILL, Role.DECODE)
    port: int = 5557
    replay_port: int | None = 5558
    topic: str = ""
    dp_size: int = 1
    max_blocks_per_stream: int = 200_000
    max_frame_bytes: int = 4 * 1024 * 1024
    replay_timeout_s: float = 2.0
    max_held: int = 1024
    port_offset: int | None = None  # set: rank 0 publishes on the worker's HTTP port + this (`port` unused)
    replay_offset: int | None = None  # with port_offset: the replay socket on the HTTP port + this; None: none

    def endpoints(self, worker_id: str, worker_url: str, dp_size: int = 1) -> list[RankPublisher]:
        """Where the worker at `worker_url` publishes, every rank (`dp_size` > 1: the worker's own ranks, else
        the block's `dp_size`)."""
        ranks = dp_size if dp_size > 1 else self.dp_size
        port, replay = self.ports(worker_url)
        return endpoints_near(worker_id, worker_url, port, replay, self.topic, ranks)

    def ports(self, worker_url: str | None = None) -> tuple[int, int | None]:
        """Rank 0's publisher and replay ports for the worker at `worker_url` (needed only with offsets)."""
        if self.port_offset is None:
            return self.port, self.replay_port
        if worker_url is None:
            raise ConfigError("kv_events: ports relative to the HTTP port need the worker's URL")
        http = url_port(worker_url)
        port = http + self.port_offset
        replay = None if self.replay_offset is None else http + self.replay_offset
        last = max(port, replay or 0) + max(self.dp_size, 1) - 1
        if min(port, replay or port) < 1 or last > 65535:
            raise ConfigError(f"kv_events: {worker_url} plus the port offsets is not a TCP port for every rank")
        return port, replay

    def limits(self) -> SubscriberLimits:
        return SubscriberLimits(
            stream=StreamLimits(self.max_frame_bytes, self.replay_timeout_s, self.max_held),
        )

    def engine_config(self, worker_url: str | None = None) -> str:
        """The `--kv-events-config` an engine needs to publish where these settings look (JSON); with offsets,
        for the engine serving at `worker_url`."""
        port, replay = self.ports(worker_url)
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": None if replay is None else f"tcp://*:{replay}",
            "topic": self.topic,
        }
        return json.dumps(config, sort_keys=True, separators=(",", ":"))


_KEYS = {
    "enabled",
    "roles",
    "port",
    "replay_port",
    "topic",
    "dp_size",
    "max_blocks_per_stream",
    "max_frame_bytes",
    "replay_timeout",
    "max_held",
    "port_offset",
    "replay_offset",
}


def parse_kv_events(raw: Mapping[str, Any] | KvEventSettings | None) -> KvEventSettings:
    """The value of the `kv_events:` block (None: off)."""
    if raw is None:
        return KvEventSettings()
    if isinstance(raw, KvEventSettings):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"kv_events: expected a mapping, got {type(raw).__name__}")
    extra = set(raw) - _KEYS
    if extra:
        raise ConfigError(f"kv_events: unknown option(s) {sorted(map(str, extra))}; known: {sorted(_KEYS)}")
    d = KvEventSettings()
    dp_size = values.integer(raw.get("dp_size", d.dp_size), "kv_events.dp_size", low=1, high=1024)
    port, replay_port, port_offset, replay_offset = _ports(raw, dp_size)
    topic = raw.get("topic", d.topic)
    if not isinstance(topic, str):
        raise ConfigError(f"kv_events.topic: expected a string, got {topic!r}")
    return KvEventSettings(
        enabled=values.boolean(raw.get("enabled", True), "kv_events.enabled"),
        roles=_roles(raw.get("roles", [str(r) for r in d.roles])),
        port=port,
        replay_port=replay_port,
        topic=topic,
        dp_size=dp_size,
        max_blocks_per_stream=values.integer(
            raw.get("max_blocks_per_stream", d.max_blocks_per_stream), "kv_events.max_blocks_per_stream", low=1
        ),
        max_frame_bytes=values.integer(
            raw.get("max_frame_bytes", d.max_frame_bytes), "kv_events.max_frame_bytes", low=1024
        ),
        replay_timeout_s=values.seconds(raw.get("replay_timeout", d.replay_timeout_s), "kv_events.replay_timeout"),
        max_held=values.integer(raw.get("max_held", d.max_held), "kv_events.max_held", low=1),
        port_offset=port_offset,
        replay_offset=replay_offset,
    )


def _ports(raw: Mapping[str, Any], dp_size: int) -> tuple[int, int | None, int | None, int | None]:
    """(port, replay_port, port_offset, replay_offset): absolute ports, or offsets from each worker's HTTP port."""
    d = KvEventSettings()
    if "port_offset" in raw:
        if "port" in raw or "replay_port" in raw:
            raise ConfigError("kv_events: give port/replay_port (absolute) or port_offset/replay_offset, not both")
        offset = values.integer(raw["port_offset"], "kv_events.port_offset", low=-65535, high=65535)
        replay = raw.get("replay_offset")
        replay_offset = None if replay is None else values.integer(replay, "kv_events.replay_offset", low=-65535)
        if offset == 0 or replay_offset == 0:
            raise ConfigError("kv_events: an offset of 0 is the worker's own HTTP port")
        if replay_offset is not None and abs(replay_offset - offset) < dp_size:
            raise ConfigError("kv_events: the ranks' publisher and replay ports overlap (they are port + rank)")
        return d.port, None, offset, replay_offset
    if "replay_offset" in raw:
        raise ConfigError("kv_events: replay_offset goes with port_offset")
    port = values.port(raw.get("port", d.port), "kv_events.port")
    replay = raw.get("replay_port", d.replay_port)
    replay_port = None if replay is None else values.port(replay, "kv_events.replay_port")
    if port + dp_size - 1 > 65535 or (replay_port is not None and replay_port + dp_size - 1 > 65535):
        raise ConfigError("kv_events: port + dp_size - 1 (the last rank's port) is past 65535")
    if replay_port is not None and abs(replay_port - port) < dp_size:
        raise ConfigError("kv_events: the ranks' publisher and replay ports overlap (they are port + rank)")
    return port, replay_port, None, None


def _roles(value: Any) -> tuple[Role, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"kv_events.roles: expected a non-empty list of roles, got {value!r}")
    try:
        roles = {Role(item) for item in value}
    except ValueError:
        raise ConfigError(f"kv_events.roles: {value!r} names a role other than prefill or decode") from None
    return tuple(role for role in Role if role in roles)
