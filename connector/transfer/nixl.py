"""``NixlBackend``: the ``TransferBackend`` (``base.py``) over NIXL.

This is the only module that imports NIXL, and it does so lazily inside ``NixlBackend``, so
``import connector.transfer.nixl`` works without NIXL installed. ``connector.transfer.memory`` offers
the same interface in memory for unit tests.

Contract for every backend: **one thread calls it** (the transfer thread). The NIXL agent runs in its
default unsynchronised mode, which is only safe under that rule. Who progresses UCX is the progress
model (``connector.options``): ``poll``, no NIXL progress thread, the owner thread progresses by polling
``poll_notices`` and ``write_state``; ``thread``, NIXL's progress thread made event-driven
(``make_agent``). Descriptor lists are handed to NIXL in compact form (``layout.strided_descriptors``),
and a peer loaded for notices only (decode's view of prefill) gets none.

A WRITE posts one descriptor per run of blocks consecutive on P and on D, per region (``layout.block_runs``):
with long runs (``layout.runs_as_lists``) as a per-request list of those rows (``layout.run_descriptors``,
``initialize_xfer``); otherwise, and for TP head slices, by indexing the prepared per-block lists, where NIXL's
``make_prepped_xfer`` merges index entries contiguous on both sides into the same rows.
``WriteTicket.num_descriptors`` counts what is posted (``connector/README.md``, "Descriptors at scale").
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from connector.parallel.topology import Slice
from connector.transfer.base import TransferError, WriteState, WriteTicket
from connector.transfer.layout import (
    IndexArray,
    block_runs,
    descriptor_indices,
    pair_blocks,
    posted_descriptors,
    run_descriptors,
    run_shape,
    runs_as_lists,
    sliced_layout,
    sliced_strided_descriptors,
    strided_descriptors,
)
from connector.wire.metadata import HandshakePayload, KVLayout

logger = logging.getLogger(__name__)


@dataclass
class _Peer:
    layout: KVLayout
    dlist: Any  # NIXL's prepared remote descriptor list; None: notices only (never written to)
    metadata: bytes
    slices: tuple[Slice, ...] | None = None  # head slices of a TP leg; None: whole blocks
    local_dlist: Any = None  # with slices: our list of the source slices


def make_agent(name: str, backends: tuple[str, ...], progress_thread_delay_us: int | None) -> Any:
    """A NIXL agent; with a progress thread, one that sleeps on UCX's event fd instead of spinning.

    NIXL's Python API builds its ``nixlAgentConfig`` with ``pthrDelay = 0`` (a busy loop, about one core
    per agent) and offers no parameter for it, so the native constructor is wrapped for this one call
    to set the delay (the module attribute is restored before returning)."""
    from nixl._api import nixl_agent, nixl_agent_config

    if progress_thread_delay_us is None:
        return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=list(backends)))
    module = sys.modules[type(nixl_agent_config()).__module__]  # nixl_cu12/13._api: the one NIXL loaded
    native = module.nixlBind
    delay = int(progress_thread_delay_us)

    class _Bind:
        def __getattr__(self, attr: str) -> Any:
            return getattr(native, attr)

        @staticmethod
        def nixlAgent(agent_name: str, config: Any) -> Any:  # NIXL's name
            config.pthrDelay = delay
            return native.nixlAgent(agent_name, config)

    with _PATCH_LOCK:
        setattr(module, "nixlBind", _Bind())  # noqa: B010 (a module attribute mypy cannot see)
        try:
            return nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=list(backends)))
        finally:
            setattr(module, "nixlBind", native)  # noqa: B010


_PATCH_LOCK = threading.Lock()


class NixlBackend:
    """``TransferBackend`` over a NIXL agent (UCX by default), DRAM or VRAM."""

    def __init__(
        self,
        name: str,
        layout: KVLayout,
        backends: tuple[str, ...] = ("UCX",),
        registrations: npt.NDArray[np.uint64] | None = None,
        progress_thread_delay_us: int | None = None,
    ) -> None:
        """``registrations``: ``(K, 3)`` rows ``(address, length, device id)`` to register with NIXL,
        one per backing storage (``connector.kvcache.KVCaches.registrations``); without them, each
        region is registered on its own (tests over plain arrays). ``progress_thread_delay_us``: run
        NIXL's UCX progress thread, sleeping in ``poll()`` up to that long (``connector.options``);
        None: no progress thread (the owner thread progresses UCX when it polls)."""
        self._agent: Any = make_agent(name, backends, progress_thread_delay_us)
        self._name = name
        self._layout = layout
        if registrations is None:
            regions = [(r.base, r.block_len * r.num_blocks, layout.device_id, "") for r in layout.regions]
            self._registered = self._agent.register_memory(regions, layout.mem_type)
        else:
            self._registered = self._agent.register_memory(registrations, layout.mem_type)
        # Compact form (one row per region, NIXL expands it to every block in the same order): Python
        # never builds the N x 3 list, here nor per peer (64 layers x 60k blocks = 3.8 M rows).
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", strided_descriptors(layout), layout.mem_type)
        self._peers: dict[str, _Peer] = {}
        self._handles: dict[int, Any] = {}
        self._next_handle = 0

    @property
    def agent_name(self) -> str:
        return self._name

    def agent_metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(
        self, payload: HandshakePayload, *, writes_to: bool = True, slices: tuple[Slice, ...] | None = None
    ) -> None:
        """``slices``: a TP leg (``connector.parallel.topology``) writes only these byte ranges of each block."""
        known = self._peers.get(payload.agent_name)
        if known is not None and known.metadata == payload.agent_metadata and known.slices == slices:
            if writes_to and known.dlist is None:
                known.dlist = self._prep_remote(payload.agent_name, payload.layout)
            return
        if known is not None:
            self.remove_peer(payload.agent_name)
        try:
            added = self._agent.add_remote_agent(payload.agent_metadata)
        except Exception as exc:  # nixl raises its own binding exceptions
            raise TransferError(f"could not load agent {payload.agent_name!r}: {exc}") from exc
        name = added.decode() if isinstance(added, bytes) else str(added)
        if name != payload.agent_name:
            raise TransferError(f"peer metadata names agent {name!r}, handshake said {payload.agent_name!r}")
        if slices is None:
            dlist = self._prep_remote(name, payload.layout) if writes_to else None
            self._peers[name] = _Peer(payload.layout, dlist, payload.agent_metadata)
            return
        src, dst = [(s.src, s.length) for s in slices], [(s.dst, s.length) for s in slices]
        rows = sliced_strided_descriptors(payload.layout, dst)
        remote = self._agent.prep_xfer_dlist(name, rows, payload.layout.mem_type)
        local_rows = sliced_strided_descriptors(self._layout, src)
        local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, self._layout.mem_type)
        self._peers[name] = _Peer(payload.layout, remote, payload.agent_metadata, slices, local)

    def _prep_remote(self, name: str, layout: KVLayout) -> Any:
        return self._agent.prep_xfer_dlist(name, strided_descriptors(layout), layout.mem_type)

    def remove_peer(self, agent_name: str) -> None:
        peer = self._peers.pop(agent_name, None)
        if peer is None:
            return
        try:
            for dlist in (peer.dlist, peer.local_dlist):
                if dlist is not None:
                    dlist.release()
            self._agent.remove_remote_agent(agent_name)
        except Exception:  # nixl raises its own binding exceptions
            logger.warning("could not remove NIXL agent %s", agent_name, exc_info=True)

    def send_notice(self, agent_name: str, message: bytes) -> None:
        try:
            self._agent.send_notif(agent_name, message)
        except Exception as exc:  # nixl raises its own binding exceptions
            raise TransferError(f"send_notif to {agent_name!r} failed: {exc}") from exc

    def poll_notices(self) -> list[tuple[str, bytes]]:
        return [
            (agent.decode() if isinstance(agent, bytes) else agent, msg)
            for agent, msgs in self._agent.get_new_notifs().items()
            for msg in msgs
        ]

    def write(
        self,
        agent_name: str,
        local_blocks: tuple[int, ...],
        remote_blocks: tuple[int, ...],
        notice: bytes,
        layers: tuple[int, int] | None = None,
    ) -> WriteTicket:
        peer = self._peers.get(agent_name)
        if peer is None or peer.dlist is None:
            raise TransferError(f"WRITE to unknown or notices-only agent {agent_name!r}")
        local_blocks, remote_blocks = pair_blocks(local_blocks, remote_blocks)
        parts = None if peer.slices is None else [(s.src, s.dst, s.length) for s in peer.slices]
        as_lists = parts is None and runs_as_lists(block_runs(local_blocks, remote_blocks)[2].size, len(local_blocks))
        if as_lists:  # long runs: a per-request list of one row per run and region
            rows = run_descriptors(self._layout, peer.layout, local_blocks, remote_blocks, None, layers)
            posted = len(rows[0])
        else:  # short runs or head slices: the prepared per-block lists, indexed; NIXL merges what is contiguous
            indices = self._indices(peer, local_blocks, remote_blocks, layers)
            posted = posted_descriptors(self._layout, peer.layout, local_blocks, remote_blocks, parts, layers)
        try:
            if as_lists:
                local = self._agent.get_xfer_descs(rows[0], self._layout.mem_type)
                remote = self._agent.get_xfer_descs(rows[1], peer.layout.mem_type)
                xfer = self._agent.initialize_xfer("WRITE", local, remote, agent_name, notice)
            else:
                local_dlist = self._local_dlist if peer.slices is None else peer.local_dlist
                xfer = self._agent.make_prepped_xfer(
                    "WRITE", local_dlist, indices[0], peer.dlist, indices[1], notice, skip_desc_merge=False
                )
            state = self._agent.transfer(xfer)
        except Exception as exc:
            raise TransferError(f"WRITE to {agent_name!r} could not be posted: {exc}") from exc
        if state == "ERR":
            xfer.release()
            raise TransferError(f"WRITE to {agent_name!r} failed at post")
        self._next_handle += 1
        self._handles[self._next_handle] = xfer
        regions = self._layout.regions[slice(*(layers or (None, None)))]
        per_block = sum(n for r in regions for _, _, n in parts or ((0, 0, r.block_len),))
        return WriteTicket(
            self._next_handle, per_block * len(local_blocks), posted, run_shape(local_blocks, remote_blocks)
        )

    def _indices(
        self, peer: _Peer, local_blocks: tuple[int, ...], remote_blocks: tuple[int, ...], layers: tuple[int, int] | None
    ) -> tuple[IndexArray, IndexArray]:
        """Indices into the prepared lists (ours, the peer's; a TP leg's sliced lists), region-major."""
        local_layout, remote_layout = self._layout, peer.layout
        if peer.slices is not None:
            local_layout = sliced_layout(self._layout, [(s.src, s.length) for s in peer.slices])
            remote_layout = sliced_layout(peer.layout, [(s.dst, s.length) for s in peer.slices])
        local_idx = descriptor_indices(local_layout, local_blocks)
        remote_idx = descriptor_indices(remote_layout, remote_blocks)
        if layers is not None:  # region-major: layer l's rows are a contiguous run (k rows per layer under slices)
            k = len(local_layout.regions) // len(self._layout.regions)
            lo, hi = layers[0] * k * len(local_blocks), layers[1] * k * len(local_blocks)
            local_idx, remote_idx = local_idx[lo:hi], remote_idx[lo:hi]
        return local_idx, remote_idx

    def write_state(self, handle: int) -> WriteState:
        state: WriteState = self._agent.check_xfer_state(self._handles[handle])
        return state

    def release(self, handle: int) -> bool:
        xfer = self._handles.get(handle)
        if xfer is None:
            return True
        try:
            xfer.release()
        except Exception:  # NIXL could not cancel it: DMA may still be running
            logger.warning("NIXL refused to release transfer handle %d (kept)", handle, exc_info=True)
            return False
        del self._handles[handle]
        return True

    def close(self) -> None:
        for handle in list(self._handles):
            self.release(handle)
        for peer in self._peers.values():
            for dlist in (peer.dlist, peer.local_dlist):
                if dlist is not None:
                    dlist.release()
        self._local_dlist.release()
        self._agent.deregister_memory(self._registered)
