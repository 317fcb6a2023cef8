"""What the transfer thread's owner loop is told and keeps (``connector.transfer_thread``): the orders the worker
submits, the side channel's peer events, and a posted WRITE's record. Plain data, no behaviour."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from connector.transfer.base import WriteTicket
from connector.transfer.layered import StepLayers
from connector.transfer.ready import ReadyEvent
from connector.wire.metadata import HandshakePayload
from connector.wire.plan import (
    CancelUnallocated,
    PrefillFailed,
    PrefillFinished,
    PrefillProgress,
    PrefillRestarted,
    RegisterOrder,
)
from connector.wire.side_channel import PeerHandle


@dataclass(frozen=True)
class CancelOrder:
    """D: vLLM finished ``request_id`` while it still waited for KV."""

    request_id: str


@dataclass(frozen=True)
class PeerReady:
    payload: HandshakePayload
    clock_offset: float


@dataclass(frozen=True)
class PeerLost:
    engine_id: str
    link: PeerHandle | None = None  # the link that ended (a stale one is ignored), None: the server's


@dataclass
class AddPeer:
    payload: HandshakePayload
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


Order = (
    RegisterOrder
    | PrefillFinished
    | PrefillFailed
    | PrefillProgress
    | PrefillRestarted
    | CancelOrder
    | CancelUnallocated
)


@dataclass(frozen=True)
class Gated:
    """An order and the event after which its blocks hold the step's KV (``connector.transfer.ready``)."""

    order: Order
    ready: ReadyEvent
    layers: StepLayers | None = None  # push_granularity "layer": the step's per-layer readiness (layer_push)


@dataclass
class Quiesce:
    """P: vLLM preempted these transfers' legs and freed their blocks; ``done`` is set once no WRITE of any of
    ``keys`` is in flight (``timed_out``: set at ``deadline`` instead, with a WRITE still running)."""

    keys: frozenset[str]
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    timed_out: bool = False


Command = Gated | PeerReady | PeerLost | AddPeer | Quiesce


@dataclass
class Write:
    ticket: WriteTicket
    agent: str
    started: float
    failed: bool = False  # ERR or abandoned: waiting for the backend to release the handle
    final: bool = True  # carries Done (a partial WRITE of progressive push does not, G14)
    ordinal: int = 1  # the how-manieth WRITE of its transfer
