"""What the scheduler half asks of the worker half in one engine step: the ``StepPlan`` and its orders.

Built by ``connector.scheduler`` in the EngineCore process, carried by vLLM to every worker in
``connector.plugin.KvpushMetadata`` (in process or pickled: never on the P-D wire, so never versioned), read by
``connector.worker``, whose orders reach the transfer thread (``connector.orders``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from connector.wire.metadata import PeerAddress


@dataclass(frozen=True)
class RegisterOrder:
    """D: register ``block_ids`` of ``request_id`` with the prefill at ``peer``."""

    request_id: str
    key: str
    peer: PeerAddress
    block_ids: tuple[int, ...]
    num_tokens: int = 0  # the request's prompt length


@dataclass(frozen=True)
class CancelUnallocated:
    """D: vLLM finished ``request_id`` before it allocated blocks; tell the prefill at ``peer``
    (it may hold blocks for ``key`` until its lease ends)."""

    request_id: str
    key: str
    peer: PeerAddress


@dataclass(frozen=True)
class PrefillFinished:
    """P: the prefill of ``request_id`` is done; its KV sits in ``block_ids`` (held for us)."""

    request_id: str
    key: str
    block_ids: tuple[int, ...]
    num_tokens: int = 0  # the prompt length (0: not known)


@dataclass(frozen=True)
class PrefillFailed:
    """P: the prefill of ``request_id`` ended without KV (abort, error); tell its decode.
    ``held``: vLLM keeps its blocks for us (a partial WRITE may read them, G14) until they are released."""

    request_id: str
    key: str
    reason: str
    held: bool = False


@dataclass(frozen=True)
class PrefillProgress:
    """P, progressive push (G14): a step of the chunked prefill of ``request_id`` ended; ``block_ids`` are
    the prompt's full blocks computed so far (a prefix of its ``total_blocks``)."""

    request_id: str
    key: str
    block_ids: tuple[int, ...]
    total_blocks: int
    num_tokens: int


@dataclass(frozen=True)
class PrefillRestarted:
    """P: vLLM preempted ``request_id`` after partial WRITEs: from now on only the final WRITE, of every block."""

    request_id: str
    key: str


@dataclass(frozen=True)
class PrefillPreempted:
    """P: vLLM preempted ``request_id`` and freed its blocks while a WRITE of ``key`` may still read them: the
    worker waits for that WRITE before the step's forward may reuse the blocks (``handle_preemptions``)."""

    request_id: str
    key: str


@dataclass
class StepPlan:
    """Everything the scheduler half asks of the worker half in one engine step."""

    register: list[RegisterOrder] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)  # D request ids aborted while awaiting KV
    cancel_unallocated: list[CancelUnallocated] = field(default_factory=list)
    finished: list[PrefillFinished] = field(default_factory=list)
    failed: list[PrefillFailed] = field(default_factory=list)
    # P: prompts whose last token this step computes; posted from the end-of-step hook (G10)
    completing: list[PrefillFinished] = field(default_factory=list)
    # P: full blocks of chunked prefills computed by this step; posted from the end-of-step hook (G14)
    progress: list[PrefillProgress] = field(default_factory=list)
    restarted: list[PrefillRestarted] = field(default_factory=list)  # P: preempted legs (step start)
    preempted: list[PrefillPreempted] = field(default_factory=list)  # P: fence their WRITEs before the forward

    def is_empty(self) -> bool:
        return not (
            self.register
            or self.cancel
            or self.cancel_unallocated
            or self.finished
            or self.failed
            or self.completing
            or self.progress
            or self.restarted
            or self.preempted
        )
