"""Which prefill rank writes which bytes of which decode rank's blocks, under TP (and PP on prefill).

Pure arithmetic, no I/O. A transfer between a prefill engine (``p_tp`` x ``p_pp`` ranks) and a decode engine
(``d_tp`` ranks, PP 1) is a set of **legs**: one per (P rank, D rank) pair that shares bytes. Every leg is a
pairwise transfer of today's kind, restricted to some **slices** of each block (byte ranges inside one block of
a layer) and to the P stage's **layers**.

Heads. A model has ``num_kv_heads`` KV heads. With ``tp <= num_kv_heads`` rank ``r`` holds heads
``r*H/tp .. (r+1)*H/tp - 1``; with ``tp > num_kv_heads`` every rank holds one head, head ``r // (tp/H)``
(replicated ``tp/H`` times). Anything else (H not a multiple of tp, nor tp of H) is refused, as vLLM does. In
a block of a layer (LBHNC: heads outermost inside a block) a rank's ``i``-th head occupies bytes
``[i*head_bytes, (i+1)*head_bytes)``.

The rule: **each head of each D rank is written by exactly one P rank**: among the P ranks holding it, holder
``d mod (number of holders)`` (so replicated heads spread over their holders and are never copied twice).
Consecutive heads with the same source whose bytes are contiguous on both sides merge into one slice.
PP prefill: stage ``s`` holds the layers ``layer_windows[s]`` and writes exactly those; decode holds all.

``sources(d)``: the P ranks whose ``Done`` D rank ``d`` must see before the request is received
(``connector.parallel.fanin``); ``targets(p)``: the D ranks P rank ``p`` writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from connector.wire.metadata import RankId


class TopologyError(ValueError):
    """A TP/PP combination kvpush cannot split heads for; the text says why."""


@dataclass(frozen=True)
class Slice:
    """``length`` bytes at ``src`` inside a P block go to ``dst`` inside a D block (same layer)."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class Leg:
    src: RankId  # the P rank
    dst: int  # the D rank (decode is PP 1)
    slices: tuple[Slice, ...]
    layers: tuple[int, int]  # [first, end) layers this leg writes
    whole_blocks: bool  # one slice covering both blocks entirely: today's descriptors, unsliced


def heads_of(rank: int, tp: int, num_kv_heads: int) -> tuple[int, ...]:
    """The KV heads TP rank ``rank`` of ``tp`` holds, in the order they sit in its blocks."""
    _check_tp(tp, num_kv_heads)
    if not 0 <= rank < tp:
        raise TopologyError(f"rank {rank} outside tensor_parallel_size {tp}")
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return tuple(range(rank * per, (rank + 1) * per))
    return (rank // (tp // num_kv_heads),)


def _check_tp(tp: int, num_kv_heads: int) -> None:
    if tp < 1 or num_kv_heads < 1:
        raise TopologyError(f"need tensor_parallel_size >= 1 and num_kv_heads >= 1, got {tp} and {num_kv_heads}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise TopologyError(
            f"tensor_parallel_size {tp} and {num_kv_heads} KV heads: one must divide the other to split heads"
        )


def even_layer_windows(num_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """Layers per PP stage, split as evenly as possible (earlier stages take the remainder)."""
    if pp < 1 or num_layers < pp:
        raise TopologyError(f"cannot split {num_layers} layers over pipeline_parallel_size {pp}")
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        end = start + base + (1 if s < extra else 0)
        out.append((start, end))
        start = end
    return tuple(out)


@dataclass(frozen=True)
class Topology:
    p_tp: int
    d_tp: int
    num_kv_heads: int
    head_bytes: int  # one KV head's bytes in one block of one layer region
    layer_windows: tuple[tuple[int, int], ...]  # per P stage; decode holds them all
    legs: tuple[Leg, ...]

    def sources(self, d_rank: int) -> tuple[RankId, ...]:
        return tuple(sorted({leg.src for leg in self.legs if leg.dst == d_rank}))

    def targets(self, p_rank: RankId) -> tuple[int, ...]:
        return tuple(sorted({leg.dst for leg in self.legs if leg.src == p_rank}))

    def legs_into(self, d_rank: int) -> tuple[Leg, ...]:
        return tuple(leg for leg in self.legs if leg.dst == d_rank)

    def block_bytes(self, tp: int) -> int:
        """Bytes of one block of one layer region on a rank of an engine with ``tp`` ranks."""
        return len(heads_of(0, tp, self.num_kv_heads)) * self.head_bytes


def plan(
    *,
    p_tp: int,
    d_tp: int,
    num_kv_heads: int,
    head_bytes: int,
    num_layers: int,
    p_pp: int = 1,
    layer_windows: tuple[tuple[int, int], ...] | None = None,
) -> Topology:
    """Every leg of a transfer from a ``p_tp`` x ``p_pp`` prefill engine to a ``d_tp`` decode engine."""
    _check_tp(p_tp, num_kv_heads)
    _check_tp(d_tp, num_kv_heads)
    if head_bytes < 1:
        raise TopologyError(f"head_bytes must be >= 1, got {head_bytes}")
    windows = layer_windows if layer_windows is not None else even_layer_windows(num_layers, p_pp)
    if len(windows) != p_pp or [w[0] for w in windows][1:] != [w[1] for w in windows][:-1]:
        raise TopologyError(f"layer windows {windows} do not tile {p_pp} stage(s)")
    if windows[0][0] != 0 or windows[-1][1] != num_layers:
        raise TopologyError(f"layer windows {windows} do not cover the {num_layers} layers")
    holders: dict[int, list[int]] = {}
    for p in range(p_tp):
        for h in heads_of(p, p_tp, num_kv_heads):
            holders.setdefault(h, []).append(p)
    legs: list[Leg] = []
    p_block, d_block = (len(heads_of(0, tp, num_kv_heads)) * head_bytes for tp in (p_tp, d_tp))
    for d in range(d_tp):
        per_source: dict[int, list[Slice]] = {}
        for j, h in enumerate(heads_of(d, d_tp, num_kv_heads)):
            src = holders[h][d % len(holders[h])]
            i = heads_of(src, p_tp, num_kv_heads).index(h)
            _append_merged(per_source.setdefault(src, []), Slice(i * head_bytes, j * head_bytes, head_bytes))
        for src, slices in sorted(per_source.items()):
            whole = slices == [Slice(0, 0, p_block)] and p_block == d_block
            for stage, window in enumerate(windows):
                legs.append(Leg(RankId(stage, src), d, tuple(slices), window, whole))
    return Topology(p_tp, d_tp, num_kv_heads, head_bytes, tuple(windows), tuple(legs))


def _append_merged(slices: list[Slice], nxt: Slice) -> None:
    if slices:
        last = slices[-1]
        if last.src + last.length == nxt.src and last.dst + last.length == nxt.dst:
            slices[-1] = Slice(last.src, last.dst, last.length + nxt.length)
            return
    slices.append(nxt)
