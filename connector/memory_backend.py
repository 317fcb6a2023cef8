"""An in-memory ``TransferBackend`` for tests: agents in one process joined by a ``MemoryFabric``.

Layout addresses are real addresses (e.g. of numpy arrays), so a WRITE is a ``ctypes.memmove``
of each block pair, performed when the WRITE is first polled after ``polls_before_done`` polls,
just like a NIXL transfer that completes asynchronously. Knobs script failures.
"""

from __future__ import annotations

import ctypes
from collections import deque
from dataclasses import dataclass, field

from connector.layout import pair_blocks
from connector.metadata import HandshakePayload, KVLayout
from connector.transfer import TransferError, WriteState, WriteTicket


@dataclass
class MemoryFabric:
    """The "network": every agent by name, and the notices in flight to each."""

    agents: dict[str, MemoryBackend] = field(default_factory=dict)


@dataclass
class _Write:
    peer: str
    pairs: list[tuple[int, int, int]]  # (src address, dst address, length)
    notice: bytes
    polls_left: int
    state: WriteState = "PROC"


class MemoryBackend:
    def __init__(self, fabric: MemoryFabric, name: str, layout: KVLayout, polls_before_done: int = 1) -> None:
        self.fabric = fabric
        self._name = name
        self.layout = layout
        self.polls_before_done = polls_before_done
        self.fail_writes = False  # next WRITEs end in ERR
        self.refuse_sends = False  # send_notice raises
        self.inbox: deque[tuple[str, bytes]] = deque()
        self.peers: dict[str, KVLayout] = {}
        self.writes: dict[int, _Write] = {}
        self.closed = False
        self._next = 0
        fabric.agents[name] = self

    @property
    def agent_name(self) -> str:
        return self._name

    def agent_metadata(self) -> bytes:
        return self._name.encode()

    def add_peer(self, payload: HandshakePayload) -> None:
        if payload.agent_metadata.decode() not in self.fabric.agents:
            raise TransferError(f"no agent {payload.agent_name!r} on the fabric")
        self.peers[payload.agent_name] = payload.layout

    def send_notice(self, agent_name: str, message: bytes) -> None:
        target = self.fabric.agents.get(agent_name)
        if self.refuse_sends or agent_name not in self.peers or target is None or target.closed:
            raise TransferError(f"cannot notify {agent_name!r}")
        target.inbox.append((self._name, message))

    def poll_notices(self) -> list[tuple[str, bytes]]:
        out = list(self.inbox)
        self.inbox.clear()
        return out

    def write(
        self, agent_name: str, local_blocks: tuple[int, ...], remote_blocks: tuple[int, ...], notice: bytes
    ) -> WriteTicket:
        remote = self.peers.get(agent_name)
        if remote is None:
            raise TransferError(f"WRITE to unknown agent {agent_name!r}")
        local_blocks, remote_blocks = pair_blocks(local_blocks, remote_blocks)
        pairs = [
            (lr.base + lb * lr.block_len, rr.base + rb * rr.block_len, lr.block_len)
            for lr, rr in zip(self.layout.regions, remote.regions, strict=True)
            for lb, rb in zip(local_blocks, remote_blocks, strict=True)
        ]
        self._next += 1
        self.writes[self._next] = _Write(agent_name, pairs, notice, self.polls_before_done)
        return WriteTicket(self._next, sum(n for _, _, n in pairs), len(pairs))

    def write_state(self, handle: int) -> WriteState:
        w = self.writes[handle]
        if w.state == "PROC":
            w.polls_left -= 1
            if w.polls_left <= 0:
                w.state = "ERR" if self.fail_writes else self._land(w)
        return w.state

    def _land(self, w: _Write) -> WriteState:
        for src, dst, n in w.pairs:
            ctypes.memmove(dst, src, n)
        self.fabric.agents[w.peer].inbox.append((self._name, w.notice))
        return "DONE"

    def release(self, handle: int) -> None:
        self.writes.pop(handle, None)

    def close(self) -> None:
        self.closed = True
        self.writes.clear()
