"""The `kv_events:` block: whether the router subscribes to its engines' KV events, where they publish, the
bounds. Pure.

    kv_events:
      enabled: true
      roles: [prefill, decode]      # the pools whose engines publish (default: both)
      port: 5557                    # rank 0's publisher port on each worker's host (the engine binds tcp://*:5557)
      replay_port: 5558             # rank 0's replay port; null: the engines have none (a gap is then a hole)
      topic: kv                     # the engines' `topic` ("" by default)
      dp_size: 1                    # data-parallel ranks per engine (rank r on port + r)
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
from router.kv_events.endpoints import Endpoint, endpoints_near
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

    def endpoints(self, worker_id: str, worker_url: str) -> list[Endpoint]:
        """Where the worker at `worker_url` publishes, every rank."""
        return endpoints_near(worker_id, worker_url, self.port, self.replay_port, self.topic, self.dp_size)

    def limits(self) -> SubscriberLimits:
        return SubscriberLimits(
            stream=StreamLimits(self.max_frame_bytes, self.replay_timeout_s, self.max_held),
        )

    def engine_config(self) -> str:
        """The `--kv-events-config` an engine needs to publish where these settings look (JSON)."""
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.port}",
            "replay_endpoint": None if self.replay_port is None else f"tcp://*:{self.replay_port}",
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
    port = values.port(raw.get("port", d.port), "kv_events.port")
    replay = raw.get("replay_port", d.replay_port)
    replay_port = None if replay is None else values.port(replay, "kv_events.replay_port")
    dp_size = values.integer(raw.get("dp_size", d.dp_size), "kv_events.dp_size", low=1, high=1024)
    if port + dp_size - 1 > 65535 or (replay_port is not None and replay_port + dp_size - 1 > 65535):
        raise ConfigError("kv_events: port + dp_size - 1 (the last rank's port) is past 65535")
    if replay_port is not None and abs(replay_port - port) < dp_size:
        raise ConfigError("kv_events: the ranks' publisher and replay ports overlap (they are port + rank)")
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
    )


def _roles(value: Any) -> tuple[Role, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"kv_events.roles: expected a non-empty list of roles, got {value!r}")
    try:
        roles = {Role(item) for item in value}
    except ValueError:
        raise ConfigError(f"kv_events.roles: {value!r} names a role other than prefill or decode") from None
    return tuple(role for role in Role if role in roles)
