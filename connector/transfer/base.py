"""The transfer seam: ``TransferBackend``, what the transfer thread needs of a backend, and the values it returns.

Backends beside it: ``nixl.py`` (the product's, over NIXL), ``memory.py`` (in memory, for tests), and
``layered.py`` (a front that writes one layer's regions at a time). Contract for every backend: **one thread
calls it** (the transfer thread).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from connector.parallel.topology import Slice
from connector.wire.metadata import HandshakePayload

WriteState = Literal["PROC", "DONE", "ERR"]


class TransferError(RuntimeError):
    """A backend call failed (unknown peer, refused descriptor list, NIXL error)."""


Lengths = tuple[tuple[int, int], ...]  # (run length in blocks, how many runs of that length), by length


@dataclass(frozen=True)
class RunShape:
    """How one WRITE's block ids fall into runs of consecutive ids: on P alone, on D alone, and on both sides at
    once (what one descriptor per region covers; ``layout.block_runs``). Exported as histograms (``stats.py``)."""

    prefill: Lengths = ()
    decode: Lengths = ()
    both: Lengths = ()


@dataclass(frozen=True)
class WriteTicket:
    """A posted WRITE: the backend's handle plus what it moves (for statistics)."""

    handle: int
    num_bytes: int
    num_descriptors: int  # as posted: runs of blocks consecutive on both sides count once per region
    runs: RunShape = RunShape()


class TransferBackend(Protocol):
    """One agent: registered local KV regions, known peers, notices and block WRITEs."""

    @property
    def agent_name(self) -> str: ...

    def agent_metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``add_peer`` (sent over the side channel)."""

    def add_peer(
        self, payload: HandshakePayload, *, writes_to: bool = True, slices: tuple[Slice, ...] | None = None
    ) -> None:
        """Load a peer's agent metadata and remember its KV layout. Idempotent for the same
        metadata; metadata that changed under a known agent name (a restarted peer) is reloaded.
        ``writes_to=False``: notices only (decode never WRITEs to prefill): no descriptor list is
        prepared for it, and a WRITE to it raises ``TransferError``. ``slices``: a TP leg
        (``connector.parallel.ranks.prefill_slices``) writes only these byte ranges of each block."""

    def remove_peer(self, agent_name: str) -> None:
        """Forget a peer's agent (the caller ensures no WRITE to it is in flight)."""

    def send_notice(self, agent_name: str, message: bytes) -> None:
        """Send a standalone notification; raise ``TransferError`` if it cannot be sent."""

    def poll_notices(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as ``(sender agent name, message)``."""

    def write(
        self,
        agent_name: str,
        local_blocks: tuple[int, ...],
        remote_blocks: tuple[int, ...],
        notice: bytes,
        layers: tuple[int, int] | None = None,
    ) -> WriteTicket:
        """Post a WRITE of local blocks into the peer's blocks (tails aligned); ``notice`` is
        delivered to the peer after the data. ``layers``: only regions ``[lo, hi)`` (one per layer,
        ``connector.transfer.layered``); None: all. Raise ``TransferError`` if it cannot be posted."""

    def write_state(self, handle: int) -> WriteState: ...

    def release(self, handle: int) -> bool:
        """Forget a WRITE, cancelling it if still running. True: the handle is gone and nothing of
        it can land any more. False: the backend refused (it could not cancel every part); the
        handle is kept and the caller must keep both sides' blocks and try again."""

    def close(self) -> None: ...
