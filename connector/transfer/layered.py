"""Layer-wise push (``push_granularity: "layer"``): a prefill WRITE split into parts by layer, each part posted
as soon as its layers' KV is in the cache, while the forward pass still computes the later layers.

What stays as it was: the rendezvous machines (``connector.rendezvous.prefill``) decide *which blocks* of *which
request* are written and when (only once D's registration arrived, never for a request that was freed or
aborted, one WRITE in flight per transfer, Done only on the final one); they see one WRITE per
``StartWrite``, as with ``push_granularity: "step"``. What this module adds is *which layers of that WRITE may
be posted now*:

* ``StepLayers`` (one per engine step that computes prompt blocks): the worker thread marks layer ``i`` with a
  ``ReadyEvent`` recorded in ``save_kv_layer`` (a CUDA event after that layer's kernels on a GPU; ``READY`` on
  CPU, where the forward is synchronous) and closes the step in ``wait_for_save`` (every layer not marked by
  then gets the step's end event, so a layer vLLM never reported, e.g. under a full CUDA graph replay, is
  written after the step as with ``"step"``). The owner thread reads how many leading layers are ready.
* ``LayerParts`` (pure): one WRITE's parts. A part is the run of layers ready and not yet posted; nothing is
  posted after a part failed or after the WRITE was released (abandoned, cancelled); the WRITE is DONE only
  when every layer's part reported DONE, ERR as soon as one part did. Done: attached to the part that
  completes the layers when every earlier part already landed, else sent alone once all of them did (a
  partial WRITE's DONE means its data landed: the rule progressive push relies on, ``connector.rendezvous.prefill``).
* ``LayeredBackend``: the ``TransferBackend`` the owner thread calls (it stays the only caller of NIXL); a
  plain ``write`` passes through, ``write_layered`` returns one handle for the parts and posts them from
  ``write_state`` (each owner-thread turn) as layers become ready. ``release`` stops posting and releases
  every posted part: True only once none of them can land.

Descriptors per layer: the layout is layer-compact, one region per layer (``connector.kvcache``), so a part's
descriptors are a contiguous slice of the WRITE's region-major index list (``TransferBackend.write``'s
``layers`` argument).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from connector.transfer.base import TransferError, WriteState, WriteTicket
from connector.transfer.layout import pair_blocks, run_shape
from connector.transfer.ready import ReadyEvent

if TYPE_CHECKING:
    from connector.parallel.topology import Slice
    from connector.transfer.base import TransferBackend
    from connector.wire.metadata import HandshakePayload

logger = logging.getLogger(__name__)


class StepLayers:
    """Which layers of one step's KV are in the cache. Marked by the worker thread, read by the owner thread:
    each layer's slot is written once (a reference store) and read only after it is set."""

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError("a step has at least one layer")
        self.num_layers = num_layers
        self._events: list[ReadyEvent | None] = [None] * num_layers
        self._ready = 0  # leading layers whose events completed (owner thread only)

    def mark(self, layer: int, event: ReadyEvent) -> None:
        """Worker thread, ``save_kv_layer``: layer ``layer``'s KV is in the cache once ``event`` completed."""
        if 0 <= layer < self.num_layers and self._events[layer] is None:
            self._events[layer] = event

    def close(self, event: ReadyEvent) -> None:
        """Worker thread, ``wait_for_save``: the step's forward is launched whole; ``event`` completes after it."""
        for layer in range(self.num_layers):
            if self._events[layer] is None:
                self._events[layer] = event

    def ready(self) -> int:
        """Owner thread: how many leading layers' KV is in the cache (layer order: a stream runs them in order)."""
        while self._ready < self.num_layers:
            event = self._events[self._ready]
            if event is None or not event.query():
                break
            self._ready += 1
        return self._ready


PartsState = Literal["PROC", "NOTIFY", "DONE", "ERR"]


@dataclass
class LayerParts:
    """The decision for one layered WRITE (pure): which layers to post next, with or without Done, and its state."""

    num_layers: int
    has_notice: bool
    spans: list[tuple[int, int]] = field(default_factory=list)  # posted parts, in layer order
    landed: int = 0  # parts reported DONE
    failed: bool = False  # a part ended in ERR (or could not be posted)
    stopped: bool = False  # released: post nothing more
    notice_attached: bool = False
    notice_sent: bool = False

    @property
    def posted(self) -> int:
        """Layers ``[0, posted)`` have a part posted."""
        return self.spans[-1][1] if self.spans else 0

    def next_span(self, ready: int) -> tuple[int, int] | None:
        """The layers to post now (``ready`` leading layers are in the cache), or None."""
        hi = min(ready, self.num_layers)
        if self.failed or self.stopped or hi <= self.posted:
            return None
        return self.posted, hi

    def attach_notice(self, span: tuple[int, int]) -> bool:
        """Whether the part ``span`` carries Done: it completes the layers and every earlier part landed."""
        return self.has_notice and span[1] == self.num_layers and self.landed == len(self.spans)

    def on_posted(self, span: tuple[int, int], with_notice: bool) -> None:
        self.spans.append(span)
        self.notice_attached = self.notice_attached or with_notice

    def on_part_done(self) -> None:
        self.landed += 1

    def on_part_failed(self) -> None:
        self.failed = True

    def on_notice_sent(self) -> None:
        self.notice_sent = True

    def state(self) -> PartsState:
        if self.failed:
            return "ERR"
        if self.posted < self.num_layers or self.landed < len(self.spans):
            return "PROC"
        if self.has_notice and not (self.notice_attached or self.notice_sent):
            return "NOTIFY"  # every layer landed: Done may go now, alone
        return "DONE"


@dataclass
class _Layered:
    agent: str
    local: tuple[int, ...]
    remote: tuple[int, ...]
    notice: bytes
    layers: StepLayers
    parts: LayerParts
    handles: list[int] = field(default_factory=list)  # the inner backend's handles of parts not yet released
    running: list[int] = field(default_factory=list)  # of those, the parts not yet DONE


class LayeredBackend:
    """``TransferBackend`` that posts a layered WRITE part by part (module docstring); owner thread only."""

    def __init__(self, inner: TransferBackend, num_layers: int, layer_block_bytes: int) -> None:
        """``layer_block_bytes``: one block of one layer (the region's ``block_len``), for the size of a WRITE
        none of whose parts is posted yet (a TP leg that writes head slices counts whole blocks then)."""
        self._inner = inner
        self.num_layers = num_layers
        self._layer_block_bytes = layer_block_bytes
        self._plain: dict[int, int] = {}  # our handle -> the inner backend's
        self._layered: dict[int, _Layered] = {}
        self._next = 0
        self.parts_posted = 0  # for tests and logs

    @property
    def agent_name(self) -> str:
        return self._inner.agent_name

    def agent_metadata(self) -> bytes:
        return self._inner.agent_metadata()

    def add_peer(
        self, payload: HandshakePayload, *, writes_to: bool = True, slices: tuple[Slice, ...] | None = None
    ) -> None:
        self._inner.add_peer(payload, writes_to=writes_to, slices=slices)

    def remove_peer(self, agent_name: str) -> None:
        self._inner.remove_peer(agent_name)

    def send_notice(self, agent_name: str, message: bytes) -> None:
        self._inner.send_notice(agent_name, message)

    def poll_notices(self) -> list[tuple[str, bytes]]:
        return self._inner.poll_notices()

    def write(
        self,
        agent_name: str,
        local_blocks: tuple[int, ...],
        remote_blocks: tuple[int, ...],
        notice: bytes,
        layers: tuple[int, int] | None = None,
    ) -> WriteTicket:
        ticket = self._inner.write(agent_name, local_blocks, remote_blocks, notice, layers=layers)
        self._next += 1
        self._plain[self._next] = ticket.handle
        return WriteTicket(self._next, ticket.num_bytes, ticket.num_descriptors, ticket.runs)

    def write_layered(
        self,
        agent_name: str,
        local_blocks: tuple[int, ...],
        remote_blocks: tuple[int, ...],
        notice: bytes,
        layers: StepLayers,
    ) -> WriteTicket:
        """Post the parts whose layers are ready now (at least the first once it is); raise ``TransferError``
        when the first part cannot be posted (nothing of the WRITE can land), as ``write`` does."""
        if layers.num_layers != self.num_layers:
            raise TransferError(f"step marks {layers.num_layers} layers, the layout has {self.num_layers}")
        w = _Layered(agent_name, local_blocks, remote_blocks, notice, layers, LayerParts(self.num_layers, bool(notice)))
        first = self._post_ready(w)
        if first is None and w.parts.failed:
            raise TransferError(f"first layer part of a WRITE to {agent_name!r} could not be posted")
        per_layer = first if first is not None else self._inner_size(w)
        self._next += 1
        self._layered[self._next] = w
        runs = run_shape(*pair_blocks(local_blocks, remote_blocks))
        return WriteTicket(self._next, per_layer[0] * self.num_layers, per_layer[1] * self.num_layers, runs)

    def _inner_size(self, w: _Layered) -> tuple[int, int]:
        """(bytes, descriptors) of one layer when no part is posted yet."""
        n = min(len(w.local), len(w.remote))
        return n * self._layer_block_bytes, n

    def _post_ready(self, w: _Layered) -> tuple[int, int] | None:
        """Post the next part if its layers are ready; (bytes, descriptors) per layer of what was posted."""
        span = w.parts.next_span(w.layers.ready())
        if span is None:
            return None
        with_notice = w.parts.attach_notice(span)
        try:
            ticket = self._inner.write(w.agent, w.local, w.remote, w.notice if with_notice else b"", layers=span)
        except TransferError:
            w.parts.on_part_failed()
            return None
        w.parts.on_posted(span, with_notice)
        logger.debug("kvpush layer part %d-%d of %d posted, notice %s", span[0], span[1], self.num_layers, with_notice)
        w.handles.append(ticket.handle)
        w.running.append(ticket.handle)
        self.parts_posted += 1
        width = span[1] - span[0]
        return ticket.num_bytes // width, ticket.num_descriptors // width

    def write_state(self, handle: int) -> WriteState:
        inner = self._plain.get(handle)
        if inner is not None:
            return self._inner.write_state(inner)
        w = self._layered[handle]
        for part in list(w.running):
            state = self._inner.write_state(part)
            if state == "ERR":
                w.parts.on_part_failed()
            elif state == "DONE":
                w.running.remove(part)
                w.parts.on_part_done()
                if self._inner.release(part):  # landed: its handle is not needed any more
                    w.handles.remove(part)
        self._post_ready(w)
        parts = w.parts.state()
        if parts == "NOTIFY":
            try:
                self._inner.send_notice(w.agent, w.notice)
            except TransferError:
                w.parts.on_part_failed()
                return "ERR"
            w.parts.on_notice_sent()
            parts = "DONE"
        if parts == "DONE":
            logger.info("kvpush layered write parts=%d notice=%s", len(w.parts.spans), _how(w.parts))
        return parts

    def release(self, handle: int) -> bool:
        inner = self._plain.get(handle)
        if inner is not None:
            if self._inner.release(inner):
                del self._plain[handle]
                return True
            return False
        w = self._layered.get(handle)
        if w is None:
            return True
        w.parts.stopped = True  # nothing more of it is posted, whatever comes
        w.handles = [h for h in w.handles if not self._inner.release(h)]
        w.running = [h for h in w.running if h in w.handles]
        if w.handles:
            return False
        del self._layered[handle]
        return True

    def close(self) -> None:
        self._inner.close()


def _how(parts: LayerParts) -> str:
    """How Done travelled (for the per-transfer log line): with the last part, alone, or none (partial)."""
    return "attached" if parts.notice_attached else "alone" if parts.notice_sent else "none"


class StepsByKey:
    """P, layer-wise push: per pairing key, the ``StepLayers`` of its latest order. The fan-out's WRITEs carry leg
    keys (``connector.parallel.fanout``) and every leg of a key reads the same step, so an entry is dropped only
    once no leg of its key can write any more (``sweep``), never when one leg ends: a leg left without its step
    would post a whole WRITE before the layers were computed."""

    def __init__(self) -> None:
        self._steps: dict[str, StepLayers] = {}

    def note(self, key: str, layers: StepLayers) -> None:
        self._steps[key] = layers

    def for_write(self, key: str) -> StepLayers | None:
        return self._steps.get(key)

    def sweep(self, live: Callable[[], set[str]], slack: int = 16) -> None:
        """Drop the steps of keys no longer live; called each turn, it looks only once entries outgrow ``slack``."""
        if len(self._steps) > slack:
            alive = live()
            self._steps = {k: v for k, v in self._steps.items() if k in alive}

    def __len__(self) -> int:
        return len(self._steps)
