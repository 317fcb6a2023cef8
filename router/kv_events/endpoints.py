"""Where a worker publishes its KV events: one publisher (and replay socket) per data-parallel rank. Pure.

vLLM binds its publisher on `endpoint` (e.g. `tcp://*:5557`) and its replay socket on `replay_endpoint`; a
data-parallel engine runs one publisher per rank, the tcp port offset by the rank (a port of 0 is left alone) and
an `inproc://` name suffixed `_dp<rank>`. The router connects to them: `tcp://<worker host>:<port>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from router.errors import ConfigError


@dataclass(frozen=True, slots=True)
class RankPublisher:
    """One publisher: a worker's DP rank."""

    worker: str  # the router's worker id
    rank: int
    publisher: str  # the PUB socket to connect to
    replay: str | None  # its ROUTER replay socket; None: the publisher has none (gaps cannot be replayed)
    topic: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return (self.worker, self.rank)


def offset_for_rank(endpoint: str, rank: int) -> str:
    """The endpoint DP rank `rank` of an engine uses, given rank 0's."""
    if rank < 0:
        raise ConfigError(f"kv_events: a data-parallel rank is not negative (got {rank})")
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit() or base == "tcp":
            raise ConfigError(f"kv_events: {endpoint!r} has no port to offset")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    raise ConfigError(f"kv_events: only tcp:// and inproc:// endpoints can be offset by a DP rank ({endpoint!r})")


def endpoints_for(
    worker: str,
    publisher: str,
    replay: str | None = None,
    topic: str = "",
    dp_size: int = 1,
) -> list[RankPublisher]:
    """Every rank's endpoints of one worker, from rank 0's."""
    if dp_size < 1:
        raise ConfigError(f"kv_events: dp_size is at least 1 (got {dp_size})")
    for name, value in (("publisher", publisher), ("replay", replay)):
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"kv_events: the {name} endpoint {value!r} is not tcp://, ipc:// or inproc://")
    return [
        RankPublisher(
            worker,
            rank,
            offset_for_rank(publisher, rank),
            None if replay is None else offset_for_rank(replay, rank),
            topic,
        )
        for rank in range(dp_size)
    ]


def url_port(worker_url: str) -> int:
    """The TCP port of a worker's HTTP URL (its scheme's default when none is written)."""
    parts = urlsplit(worker_url)
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"kv_events: the worker URL {worker_url!r} has no valid port") from None
    if port is not None:
        return port
    return 443 if parts.scheme == "https" else 80


def endpoints_near(
    worker: str,
    worker_url: str,
    port: int,
    replay_port: int | None = None,
    topic: str = "",
    dp_size: int = 1,
) -> list[RankPublisher]:
    """A worker's endpoints on the host of its HTTP URL (the usual deployment: the engine binds `tcp://*:<port>`)."""
    host = urlsplit(worker_url).hostname
    if not host:
        raise ConfigError(f"kv_events: no host in the worker URL {worker_url!r}")
    if ":" in host:
        host = f"[{host}]"
    replay = None if replay_port is None else f"tcp://{host}:{replay_port}"
    return endpoints_for(worker, f"tcp://{host}:{port}", replay, topic, dp_size)
