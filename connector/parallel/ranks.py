"""One rank's part of a transfer under tensor parallelism (pure: no I/O, no clock).

``connector.parallel.topology`` decides which P rank writes which bytes of which D rank's blocks; this module turns
that into what one rank's transfer thread does:

* **Ports.** Every worker rank runs its own side channel. The port of rank ``(pp, tp)`` of an engine is
  ``side_channel_port(base, dp_index, world) + pp * tp_size + tp`` where the engine's rank-0 port is
  ``base + dp_index * world`` and ``world = tp_size * pp_size`` (``connector.kvcache.side_channel_port``).
  With TP = PP = 1 that is ``base + dp_index``, as before. The router (and the prefill's answer) names the
  rank-0 port; a D rank derives its sources' ports from it and the prefill's ``tp_size``.
* **Decode legs** (``decode_legs``): the P ranks a D rank registers with for one request, each with its own
  leg request id (the request id itself when there is one source) and address.
* **Prefill slices** (``prefill_slices``): what a P rank writes into a D rank whose handshake it answered.
* **Fan-in** (``DecodeFanIn``): a D rank's request with several sources is received only when every leg sent
  ``Done``, fails at the first failed leg (the others are cancelled) and frees its blocks only once no leg
  can still write (``connector.parallel.fanin.SourceSet``).

Supported: P_tp = D_tp (whole blocks, one leg per rank), P_tp > D_tp (each P rank writes its heads into a
slice of one D rank's blocks; that D rank fans in) and P_tp < D_tp (each D rank has one source, whose blocks
hold its heads; that P rank writes a slice of its blocks to each of its targets, ``prefill_targets``, and
fans out: ``connector.parallel.fanout``). PP prefill: every stage is one more source of each D rank
(``decode_legs``), and writes only its layers' regions of D's blocks (``stage_window``). Refused with the
reason (``Unpairable``): decode PP > 1, and what the topology cannot split.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from dataclasses import dataclass, field, replace

from connector.parallel.fanin import SourceOutcome, SourceSet
from connector.parallel.topology import Slice, TopologyError, plan
from connector.wire.metadata import KVLayout, PeerAddress, RankId, RankInfo


class Unpairable(ValueError):
    """This rank cannot take part in a transfer with that peer; the text says why."""


def rank_port(rank0_port: int, rank: RankId, tp_size: int) -> int:
    """The side-channel port of ``rank`` of an engine whose rank (0, 0) listens on ``rank0_port``."""
    return rank0_port + rank.pp * tp_size + rank.tp


def _topology_sources(p_tp: int, mine: RankInfo) -> tuple[RankId, ...]:
    if not (mine.num_kv_heads and mine.head_bytes):
        raise Unpairable(f"prefill tp_size {p_tp} != decode tp_size {mine.tp_size} and this rank's heads are unknown")
    try:
        topo = plan(
            p_tp=p_tp, d_tp=mine.tp_size, num_kv_heads=mine.num_kv_heads, head_bytes=mine.head_bytes, num_layers=1
        )
    except TopologyError as exc:
        raise Unpairable(str(exc)) from exc
    return topo.sources(mine.rank.tp)


def prefill_targets(mine: RankInfo, theirs: RankInfo) -> tuple[int, ...]:
    """The ranks of D rank ``theirs``'s engine that P rank ``mine`` writes (``connector.parallel.fanout``)."""
    if mine.tp_size == theirs.tp_size:
        return (mine.rank.tp,)
    topo = plan(
        p_tp=mine.tp_size, d_tp=theirs.tp_size, num_kv_heads=mine.num_kv_heads, head_bytes=mine.head_bytes, num_layers=1
    )
    return topo.targets(RankId(0, mine.rank.tp))


def decode_legs(request_id: str, peer: PeerAddress, mine: RankInfo) -> tuple[tuple[str, PeerAddress], ...]:
    """``(leg request id, source address)`` per P rank D rank ``mine`` registers with for ``request_id``: the P
    ranks holding its heads, in every PP stage of the prefill (each stage writes its own layers)."""
    if mine.pp_size != 1:
        raise Unpairable(f"decode pipeline_parallel_size {mine.pp_size}: kvpush writes only into a decode with PP 1")
    if peer.tp_size == mine.tp_size:
        by_tp: tuple[RankId, ...] = (RankId(0, mine.rank.tp),)
    else:
        by_tp = _topology_sources(peer.tp_size, mine)
    sources = tuple(RankId(stage, s.tp) for stage in range(peer.pp_size) for s in by_tp)
    return tuple(
        (
            request_id if len(sources) == 1 else f"{request_id}@{s.pp}.{s.tp}",
            replace(peer, port=rank_port(peer.port, s, peer.tp_size), rank=s),
        )
        for s in sources
    )


def layer_window(layer_names: tuple[str, ...], pp_size: int) -> tuple[int, int]:
    """The model layers ``[first, end)`` a rank's KV caches hold, from their names (vLLM's
    ``model.layers.<i>.self_attn.attn``): at PP 1 all of them, ``(0, count)``; a PP stage its window. ``(0, 0)``:
    not a contiguous window of numbered layers (``stage_window`` then refuses every pair)."""
    if pp_size == 1:
        return (0, len(layer_names))
    found = [re.search(r"\.(\d+)\.", f".{name}.") for name in layer_names]
    numbers = [int(m.group(1)) for m in found if m is not None]
    if not numbers or len(numbers) != len(layer_names) or numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        return (0, 0)
    return (numbers[0], numbers[-1] + 1)


def stage_window(mine: RankInfo, theirs: RankInfo, my_layout: KVLayout, their_layout: KVLayout) -> KVLayout:
    """The part of D rank ``theirs``'s layout that P rank ``mine`` writes: all of it at PP 1, else the regions of
    the layers of ``mine``'s PP stage (``RankInfo.layers``; every layer has the same number of regions on both
    sides). Raises ``Unpairable`` when the stage's layers do not fit the decode's."""
    if mine.pp_size == 1:
        return their_layout
    first, end = mine.layers
    total = theirs.layers[1] - theirs.layers[0]
    span = end - first
    if span < 1 or not 0 <= first < end <= total or theirs.layers[0] != 0 or len(my_layout.regions) % span:
        raise Unpairable(
            f"prefill stage {mine.rank.pp} holds layers [{first}, {end}) in {len(my_layout.regions)} regions, "
            f"the decode layers {list(theirs.layers)}: the stage's layers do not fit"
        )
    per_layer = len(my_layout.regions) // span
    if len(their_layout.regions) != per_layer * total:
        raise Unpairable(
            f"{per_layer} region(s) per layer here, {len(their_layout.regions)} for {total} layers on the peer"
        )
    return replace(their_layout, regions=their_layout.regions[first * per_layer : end * per_layer])


def prefill_peer(
    mine: RankInfo, theirs: RankInfo, my_layout: KVLayout, their_layout: KVLayout
) -> tuple[KVLayout, tuple[Slice, ...] | None]:
    """What P rank ``mine`` writes into D rank ``theirs``: the D regions (``stage_window``) and, in each block of
    them, whole blocks (None) or byte slices (``prefill_slices``)."""
    window = stage_window(mine, theirs, my_layout, their_layout)
    return window, prefill_slices(mine, theirs, my_layout, window)


def prefill_slices(
    mine: RankInfo, theirs: RankInfo, my_layout: KVLayout, their_layout: KVLayout
) -> tuple[Slice, ...] | None:
    """What P rank ``mine`` writes into each block of D rank ``theirs``: ``None`` for whole blocks, else byte
    slices. Raises ``Unpairable`` when the two ranks' geometries do not fit together (the text names it)."""
    if len(my_layout.regions) != len(their_layout.regions) or my_layout.block_size != their_layout.block_size:
        raise Unpairable(
            f"{len(my_layout.regions)} regions of {my_layout.block_size}-token blocks here, "
            f"{len(their_layout.regions)} of {their_layout.block_size} on the peer"
        )
    if theirs.pp_size != 1:
        raise Unpairable(f"decode pipeline_parallel_size {theirs.pp_size} is not supported")
    if mine.tp_size == theirs.tp_size:
        if mine.rank.tp != theirs.rank.tp:
            raise Unpairable(f"prefill rank {mine.rank.tp} is not the source of decode rank {theirs.rank.tp}")
        if [r.block_len for r in my_layout.regions] != [r.block_len for r in their_layout.regions]:
            raise Unpairable("block lengths differ between the two ranks at equal tp_size")
        return None
    if (mine.num_kv_heads, mine.head_bytes) != (theirs.num_kv_heads, theirs.head_bytes) or not mine.head_bytes:
        raise Unpairable(
            f"KV heads x bytes per head {mine.num_kv_heads} x {mine.head_bytes} here, "
            f"{theirs.num_kv_heads} x {theirs.head_bytes} on the peer"
        )
    me = RankId(0, mine.rank.tp)  # every PP stage splits heads alike
    if me not in _topology_sources(mine.tp_size, theirs):
        raise Unpairable(f"prefill rank {mine.rank} writes nothing into decode rank {theirs.rank.tp}")
    topo = plan(
        p_tp=mine.tp_size, d_tp=theirs.tp_size, num_kv_heads=mine.num_kv_heads, head_bytes=mine.head_bytes, num_layers=1
    )
    [leg] = [leg for leg in topo.legs if leg.src == me and leg.dst == theirs.rank.tp]
    for mine_r, theirs_r in zip(my_layout.regions, their_layout.regions, strict=True):
        if (
            mine_r.block_len != len(mine.heads) * mine.head_bytes
            or theirs_r.block_len != len(theirs.heads) * theirs.head_bytes
        ):
            raise Unpairable("a region's block length is not heads x bytes per head (not an LBHNC layout?)")
    return None if leg.whole_blocks else leg.slices


@dataclass
class _Request:
    sources: SourceSet
    legs: dict[str, Hashable]  # leg request id -> source
    aborted: bool = False  # vLLM finished it while it waited: report it only once freed


@dataclass(frozen=True)
class FanInStep:
    """What one leg event means for its request on this D rank (what the worker half is told)."""

    request_id: str
    cancel_legs: tuple[str, ...] = ()  # legs to cancel (the request failed while they were pending)
    fail_now: bool = False  # report it failed now; its blocks stay held (a quarantine to the worker half)
    finish: bool = False  # report it received: its blocks may be freed (no leg can land any more)
    ok: bool = False  # with ``finish``: every leg's data landed (valid KV)


@dataclass
class DecodeFanIn:
    """D rank: the requests with several sources (``connector.parallel.fanin.SourceSet`` per request, keyed by leg)."""

    requests: dict[str, _Request] = field(default_factory=dict)
    leg_of: dict[str, str] = field(default_factory=dict)  # leg request id -> request id

    def add(self, request_id: str, legs: tuple[tuple[str, PeerAddress], ...]) -> None:
        by_leg: dict[str, Hashable] = {leg: peer.rank for leg, peer in legs}
        # Each leg's own machine bounds it (its hold deadline), so the set needs none of its own.
        self.requests[request_id] = _Request(SourceSet(tuple(by_leg.values()), float("inf")), by_leg)
        for leg in by_leg:
            self.leg_of[leg] = request_id

    def owns(self, leg: str) -> bool:
        return leg in self.leg_of

    def legs(self, request_id: str) -> tuple[str, ...]:
        req = self.requests.get(request_id)
        return tuple(req.legs) if req is not None else ()

    def on_leg(self, leg: str, event: str) -> FanInStep:
        """``event``: ``done`` (Received ok), ``ended`` (Received not ok), ``quarantined`` (Failed), ``freed``."""
        request_id = self.leg_of[leg]
        req = self.requests[request_id]
        source = req.legs[leg]
        match event:
            case "done":
                outcome = req.sources.on_done(source)
            case "ended" | "freed":
                outcome = (
                    req.sources.on_cancel_ack(source) if event == "freed" else req.sources.on_failure(source, False)
                )
            case _:
                outcome = req.sources.on_failure(source, True)
        return self._step(request_id, req, outcome)

    def on_abort(self, request_id: str) -> FanInStep:
        req = self.requests[request_id]
        req.aborted = True
        return self._step(request_id, req, req.sources.on_abort())

    def _step(self, request_id: str, req: _Request, outcome: SourceOutcome) -> FanInStep:
        by_source = {source: leg for leg, source in req.legs.items()}
        cancel = tuple(by_source[s] for s in outcome.cancel)
        if req.sources.freed:
            del self.requests[request_id]
            for leg in req.legs:
                self.leg_of.pop(leg, None)
        return FanInStep(
            request_id,
            cancel,
            fail_now=outcome.failed and not req.aborted,
            finish=outcome.freed,
            ok=outcome.freed and req.sources.received and not req.aborted,
        )
