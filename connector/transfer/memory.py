"""An in-memory ``TransferBackend`` for tests: agents in one process joined by a ``MemoryFabric``.

Layout addresses are real addresses (e.g. of numpy arrays), so a WRITE is a ``ctypes.memmove``
of each block pair. A WRITE is split into ``subrequests`` parts (one per group of regions, like
the lanes/QPs of a real transport); each part completes after ``polls_before_done`` polls of the
handle, just like a NIXL transfer that completes asynchronously. Knobs inject faults:

* ``fail_writes``: every part of the next WRITEs ends in ERR (nothing lands, release succeeds);
* ``fail_first_part``: the first part ends in ERR at once while its siblings stay in flight for
  ``sibling_polls`` more polls and still land; ``release`` is refused while any part is in flight
  (a backend cannot always cancel what it posted);
* ``refuse_releases``: that many further ``release`` calls fail (``-1``: all of them);
* ``refuse_sends``: ``send_notice`` raises.

Each backend has an incarnation: ``agent_metadata`` names it, and a peer loaded from an older
incarnation's metadata is unusable (like UCX endpoints of a process that restarted), which is how
tests model a peer restarting under the same agent name.
"""

from __future__ import annotations

import ctypes
import uuid
from collections import deque
from dataclasses import dataclass, field

from connector.parallel.topology import Slice
from connector.transfer.base import TransferError, WriteState, WriteTicket
from connector.transfer.layout import pair_blocks, posted_descriptors, run_shape
from connector.wire.metadata import HandshakePayload, KVLayout


@dataclass
class MemoryFabric:
    """The "network": every agent by name, and the notices in flight to each."""

    agents: dict[str, MemoryBackend] = field(default_factory=dict)


@dataclass
class _Part:
    pairs: list[tuple[int, int, int]]  # (src address, dst address, length)
    polls_left: int
    fails: bool
    state: WriteState = "PROC"


@dataclass
class _Write:
    peer: str
    parts: list[_Part]
    notice: bytes
    notified: bool = False

    @property
    def in_flight(self) -> bool:
        return any(p.state == "PROC" for p in self.parts)


@dataclass
class _Peer:
    layout: KVLayout
    metadata: bytes
    writable: bool = True  # False: loaded for notices only (add_peer(writes_to=False)), a WRITE is refused
    slices: tuple[Slice, ...] | None = None  # a TP leg: only these byte ranges of each block


class MemoryBackend:
    def __init__(
        self,
        fabric: MemoryFabric,
        name: str,
        layout: KVLayout,
        polls_before_done: int = 1,
        subrequests: int = 1,
    ) -> None:
        self.fabric = fabric
        self._name = name
        self.layout = layout
        self.polls_before_done = polls_before_done
        self.subrequests = subrequests
        self.incarnation = uuid.uuid4().hex
        self.fail_writes = False
        self.fail_first_part = False
        self.sibling_polls = 20
        self.refuse_releases = 0
        self.refuse_sends = False
        self.inbox: deque[tuple[str, bytes]] = deque()
        self.peers: dict[str, _Peer] = {}
        self.writes: dict[int, _Write] = {}
        self.landed: list[tuple[int, int]] = []  # (handle, dst address) of every landed pair, in order
        self.removed: list[str] = []  # agents removed with remove_peer
        self.closed = False
        self._next = 0
        fabric.agents[name] = self

    @property
    def agent_name(self) -> str:
        return self._name

    def agent_metadata(self) -> bytes:
        return f"{self._name}|{self.incarnation}".encode()

    def add_peer(
        self, payload: HandshakePayload, *, writes_to: bool = True, slices: tuple[Slice, ...] | None = None
    ) -> None:
        name = payload.agent_metadata.decode().split("|")[0]
        if name not in self.fabric.agents:
            raise TransferError(f"no agent {payload.agent_name!r} on the fabric")
        known = self.peers.get(payload.agent_name)
        writes_to = writes_to or (known is not None and known.metadata == payload.agent_metadata and known.writable)
        self.peers[payload.agent_name] = _Peer(payload.layout, payload.agent_metadata, writes_to, slices)

    def remove_peer(self, agent_name: str) -> None:
        self.peers.pop(agent_name, None)
        self.removed.append(agent_name)

    def in_flight_to(self, agent_name: str) -> int:
        """Parts of WRITEs to ``agent_name`` that may still land (for assertions)."""
        return sum(1 for w in self.writes.values() if w.peer == agent_name for p in w.parts if p.state == "PROC")

    def _target(self, agent_name: str) -> MemoryBackend:
        peer = self.peers.get(agent_name)
        target = self.fabric.agents.get(agent_name)
        if peer is None or target is None or target.closed or target.agent_metadata() != peer.metadata:
            raise TransferError(f"cannot reach agent {agent_name!r} (unknown, closed or restarted)")
        return target

    def send_notice(self, agent_name: str, message: bytes) -> None:
        if self.refuse_sends:
            raise TransferError(f"cannot notify {agent_name!r}")
        self._target(agent_name).inbox.append((self._name, message))

    def poll_notices(self) -> list[tuple[str, bytes]]:
        out = list(self.inbox)
        self.inbox.clear()
        return out

    def write(
        self,
        agent_name: str,
        local_blocks: tuple[int, ...],
        remote_blocks: tuple[int, ...],
        notice: bytes,
        layers: tuple[int, int] | None = None,
    ) -> WriteTicket:
        self._target(agent_name)
        if not self.peers[agent_name].writable:
            raise TransferError(f"WRITE to notices-only agent {agent_name!r}")
        remote = self.peers[agent_name].layout
        local_blocks, remote_blocks = pair_blocks(local_blocks, remote_blocks)
        slices = self.peers[agent_name].slices
        pairs = [
            (lr.base + lb * lr.block_len + s.src, rr.base + rb * rr.block_len + s.dst, s.length)
            for lr, rr in list(zip(self.layout.regions, remote.regions, strict=True))[slice(*(layers or (None, None)))]
            for lb, rb in zip(local_blocks, remote_blocks, strict=True)
            for s in (slices or (Slice(0, 0, lr.block_len),))
        ]
        n = max(1, min(self.subrequests, len(pairs)))
        parts = [_Part(pairs[i::n], self.polls_before_done, self.fail_writes) for i in range(n)]
        if self.fail_first_part and not self.fail_writes:
            parts[0].fails, parts[0].polls_left = True, 1
            for part in parts[1:]:
                part.polls_left = self.sibling_polls
        self._next += 1
        self.writes[self._next] = _Write(agent_name, parts, notice)
        cuts = None if slices is None else [(s.src, s.dst, s.length) for s in slices]
        posted = posted_descriptors(self.layout, remote, local_blocks, remote_blocks, cuts, layers)
        return WriteTicket(self._next, sum(n for _, _, n in pairs), posted, run_shape(local_blocks, remote_blocks))

    def write_state(self, handle: int) -> WriteState:
        w = self.writes[handle]
        self._progress(handle, w)
        if any(p.state == "ERR" for p in w.parts):
            return "ERR"
        if w.in_flight:
            return "PROC"
        if not w.notified:
            w.notified = True
            if w.notice:  # an empty notice (a partial WRITE) is not delivered, as with NIXL
                self.fabric.agents[w.peer].inbox.append((self._name, w.notice))
        return "DONE"

    def _progress(self, handle: int, w: _Write) -> None:
        for part in w.parts:
            if part.state != "PROC":
                continue
            part.polls_left -= 1
            if part.polls_left > 0:
                continue
            if part.fails:
                part.state = "ERR"
                continue
            for src, dst, n in part.pairs:
                ctypes.memmove(dst, src, n)
                self.landed.append((handle, dst))
            part.state = "DONE"

    def release(self, handle: int) -> bool:
        w = self.writes.get(handle)
        if w is None:
            return True
        self._progress(handle, w)
        if self.refuse_releases:
            self.refuse_releases -= self.refuse_releases > 0
            return False
        if w.in_flight and any(p.state == "ERR" for p in w.parts):
            return False  # cannot cancel the siblings of a failed part
        del self.writes[handle]
        return True

    def close(self) -> None:
        self.closed = True
        self.writes.clear()
