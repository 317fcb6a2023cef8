"""What each engine's prefix cache holds, block by block, as its KV events say. Pure.

One `StreamIndex` per publisher: a worker, or one data-parallel rank of it (each rank publishes on its own port
with its own sequence). It maps the engine's block hashes to the block's *content key*: a chain key over the
token ids, `key(block) = hash((key(parent), tokens of the block))`, the root's parent key being `_ROOT`. The
router cannot recompute vLLM's own hashes (seeded, configurable, sometimes truncated to 64 bits), so it keys
what it looks up the same way from a prompt's token ids (`PromptKeys`) and asks the reverse map.

A block is matchable when its whole chain is known: its parent was indexed (or it has none), and the engine
hashed nothing but its tokens (no LoRA, multimodal input, cache salt or prompt embeddings: `Stored.keyed`).
Others are held (so their children and their removal are understood) but match nothing (`orphans`, `keyed`).
A stream's block size is its first stored block's; blocks of another size (hybrid models' partial entries) and
of another KV cache group than `group` are not indexed (`other_size`, `other_group`).

Bounded: at most `max_blocks` per stream; past it the block stored longest ago goes (`capacity`). The engine's own
LRU usually removes blocks first (BlockRemoved). A block is held per medium (GPU, CPU, storage tiers) and goes
when its last medium removes it. `Cleared` (the engine's reset_prefix_cache) empties the stream.

Copies: one hash can be held by several physical blocks of one medium (vLLM recomputes a block-aligned prompt's
last block and caches the result next to the copy it already had), and vLLM 0.32-0.34 send one BlockStored per
copy cached and one BlockRemoved per copy evicted. So each BlockStored of a hash its medium already holds counts
one more copy (`copies`), each BlockRemoved takes one away (`copy_removed` while others remain), and the medium
lets go of the block only when its last copy is removed. A removal that says how many copies remain
(`Removed.remaining`, vllm#48933) is believed over the count. A BlockStored that starts at the prompt's first
block (no parent) and whose blocks are all held already is a *reuse report* (vLLM's `kv_cache_report_mode`
"full" reports prefix-cache hits that way; they never get a removal of their own) and adds no copy
(`reports`). What counting cannot tell: an engine that sent one removal for the last of several copies
(vllm#55092's proposal, not in a release) would leave the block held here until it is stored again, pushed out
by the bound, or cleared; one removal of a block stored once removes it in every version.

Lookahead (vLLM 0.33+ with speculative decoding and lookahead hashing): a block's hash also covers the tokens
after it (`Stored.lookahead`), so the engine hits it only for a prompt that continues with those tokens. Such a
block keeps its token-only content key (its children chain from it as usual), and a lookup counts it only when
the prompt's tokens after it equal its lookahead; the check costs nothing on streams that hold no such block.
Python's `hash` of a tuple of ints is the content key: fast and stable within a process; a collision costs a
misrouted prefix estimate, never a wrong answer (the engine checks its own hashes).

Per session, the *tip*: the token ids of the blocks the session stored last in one run (a prompt's blocks, then
its answer's as decode fills them; a next prompt that branches off where the answer's text re-tokenized
differently starts a new tip) and where in the chain they start (every block's depth is known when its chain
is). The tip's end is what a next turn of the session finds held, counting once the blocks another session
stored first (a shared system prompt) and never the blocks of an answer a later prompt branched away from; its
tokens let a decider check an answer it never relayed (router/deciders/session_affinity.py). Bounded: at most
`TIP_TOKENS` per session, and a session's tip goes with its last block.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from router.kv_events.frames import BlockHash, Cleared, Event, Removed, Stored

_ROOT = 0x6B76707573680000  # the content key a prompt's first block chains from ("kvpush")
_MEDIA = {None: 1, "GPU": 1, "CPU": 2, "STORAGE": 4}
_OTHER_MEDIUM = 8
_FIRST_KEYS = 8  # prompt blocks keyed first, half as many again after: a lookup that stops early keys little
TIP_TOKENS = 2048  # the token ids of a session's last stored blocks kept, at most (8 bytes each)

StreamKey = tuple[str, int]  # (worker id, data-parallel rank)


@dataclass
class IndexCounters:
    stored: int = 0  # blocks stored (again: a reused block's store counts too)
    removed: int = 0  # blocks gone on a BlockRemoved (their last copy on their last medium)
    copies: int = 0  # BlockStored of a hash its medium already held: one more physical copy
    copy_removed: int = 0  # BlockRemoved of one copy while others remain (the block stays)
    reports: int = 0  # blocks of reuse reports (already held, stored again from the first block): no copy
    lookahead: int = 0  # blocks stored whose hash covers tokens after them
    unknown_removed: int = 0  # removals of blocks the index does not hold
    cleared: int = 0  # AllBlocksCleared events
    capacity: int = 0  # blocks pushed out by the per-stream bound
    orphans: int = 0  # blocks stored whose parent the index does not hold: matchable never
    keyed: int = 0  # blocks hashed with more than their tokens: matchable never
    other_size: int = 0  # blocks of another size than the stream's: not indexed
    other_group: int = 0  # blocks of another KV cache group: not indexed
    dropped: int = 0  # blocks dropped with a stream (worker removed or restarted, sequence lost)


class PromptKeys:
    """A prompt's chain keys, block by block: computed once for every stream that asks (per block size), and
    only as far as some stream matches (8 blocks first, then half as many again as matched so far)."""

    __slots__ = ("_keys", "_token_ids")

    def __init__(self, token_ids: Sequence[int]) -> None:
        self._token_ids = token_ids
        self._keys: dict[int, list[int]] = {}

    def blocks(self, block_size: int) -> int:
        return len(self._token_ids) // block_size

    def window(self, start: int, length: int) -> tuple[int, ...]:
        """The prompt's token ids from `start` on, `length` of them (fewer at its end)."""
        return tuple(self._token_ids[start : start + length])

    def keys(self, block_size: int, at_least: int) -> list[int]:
        """The keys of the prompt's first `at_least` whole blocks (all of them if it has fewer), maybe more."""
        keys = self._keys.setdefault(block_size, [])
        if len(keys) >= at_least:
            return keys
        tokens = self._token_ids
        parent = keys[-1] if keys else _ROOT
        end = min(at_least, len(tokens) // block_size) * block_size
        for start in range(len(keys) * block_size, end, block_size):
            parent = hash((parent, tuple(tokens[start : start + block_size])))
            keys.append(parent)
        return keys

    def key(self, block_size: int, block: int) -> int | None:
        """The content key of the prompt's `block`-th block (0-based); None past its last whole block."""
        keys = self.keys(block_size, block + 1)
        return keys[block] if block < len(keys) else None


def content_keys(token_ids: Sequence[int], block_size: int, parent: int = _ROOT) -> list[int]:
    """The chain keys of whole blocks of `token_ids`, the first chained from `parent`."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        keys.append(parent)
    return keys


@dataclass(slots=True)
class _Block:
    key: int | None  # the content key; None: not matchable
    media: int
    session: str | None  # the session of the request that stored it last (vLLM's BlockStored.session_id)
    depth: int = -1  # blocks before it in its chain; -1: unknown (a parent the index never saw)
    extra: dict[int, int] | None = None  # per medium, the copies held beyond the first; None: one per medium
    lookahead: tuple[int, ...] | None = None  # the tokens after it its hash covers; None: its own tokens only


@dataclass(slots=True)
class _Tip:
    """The blocks a session stored last, in chain order, and the chain position (tokens) of the first."""

    start: int
    hashes: list[BlockHash]
    tokens: array[int]


@dataclass(frozen=True, slots=True)
class SessionTail:
    """The token ids a worker's engine holds of a session's chain from position `start` on (whole blocks; the
    chain before `start` is held too); `end` is what a next turn of the session finds held, at most."""

    start: int
    tokens: Sequence[int]
    block_size: int

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class StreamIndex:
    max_blocks: int
    group: int = 0
    counters: IndexCounters = field(default_factory=IndexCounters)
    block_size: int | None = None
    _blocks: OrderedDict[BlockHash, _Block] = field(default_factory=OrderedDict)
    _by_key: dict[int, BlockHash] = field(default_factory=dict)
    _sessions: dict[str, int] = field(default_factory=dict)  # session -> blocks held that it stored last
    _tips: dict[str, _Tip] = field(default_factory=dict)  # session -> its tip
    _lookahead: int = 0  # blocks held that carry a lookahead

    def __post_init__(self) -> None:
        if self.max_blocks < 1:
            raise ValueError("a stream index needs room for at least one block")

    def __len__(self) -> int:
        return len(self._blocks)

    def matchable(self) -> int:
        return len(self._by_key)

    def apply(self, events: Iterable[Event]) -> None:
        for event in events:
            if isinstance(event, Stored):
                self.stored(event)
            elif isinstance(event, Removed):
                self.removed(event)
            elif isinstance(event, Cleared):
                self.cleared()

    def stored(self, event: Stored) -> None:
        if (event.group or 0) != self.group:
            self.counters.other_group += len(event.hashes)
            return
        if self.block_size is None:
            self.block_size = event.block_size
        elif event.block_size != self.block_size:
            self.counters.other_size += len(event.hashes)
            return
        medium = _MEDIA.get(event.medium, _OTHER_MEDIUM)
        report = self._is_report(event, medium)
        parent_key = self._parent_key(event)
        depth = self._depth(event.parent)
        size = event.block_size
        lookahead = event.lookahead
        for i, block_hash in enumerate(event.hashes):
            key = None
            if parent_key is not None:
                key = hash((parent_key, event.token_ids[i * size : (i + 1) * size]))
            block = self._put(block_hash, key, medium, event.session_id, depth + i if depth >= 0 else -1, report)
            self._set_lookahead(block, lookahead[i] if lookahead is not None else None)
            parent_key = key
        self.counters.stored += len(event.hashes)
        if report:
            self.counters.reports += len(event.hashes)
        if lookahead is not None:
            self.counters.lookahead += len(event.hashes)
        if event.session_id is not None and depth >= 0 and event.hashes:
            self._grow_tip(event.session_id, event, depth * size)
        while len(self._blocks) > self.max_blocks:
            block_hash, block = self._blocks.popitem(last=False)
            self._forget(block_hash, block)
            self.counters.capacity += 1

    def _is_report(self, event: Stored, medium: int) -> bool:
        """A reuse report: blocks from the prompt's first one that this medium holds already, every one."""
        if event.parent is not None or not event.hashes:
            return False
        blocks = self._blocks
        return all((block := blocks.get(h)) is not None and block.media & medium for h in event.hashes)

    def _set_lookahead(self, block: _Block, lookahead: tuple[int, ...] | None) -> None:
        self._lookahead += (lookahead is not None) - (block.lookahead is not None)
        block.lookahead = lookahead

    def _parent_key(self, event: Stored) -> int | None:
        if event.keyed:
            self.counters.keyed += len(event.hashes)
            return None
        if event.parent is None:
            return _ROOT
        parent = self._blocks.get(event.parent)
        if parent is None:
            self.counters.orphans += len(event.hashes)
            return None
        if parent.key is None:
            self.counters.orphans += len(event.hashes)
        return parent.key

    def _depth(self, parent: BlockHash | None) -> int:
        """The depth of a block stored after `parent`; -1 when the parent's is unknown."""
        if parent is None:
            return 0
        block = self._blocks.get(parent)
        return block.depth + 1 if block is not None and block.depth >= 0 else -1

    def _grow_tip(self, session: str, event: Stored, start: int) -> None:
        """The session's tip extended by the event's blocks when they follow it, else replaced by them."""
        size = event.block_size
        ids = event.token_ids[: len(event.hashes) * size]
        tip = self._tips.get(session)
        if tip is not None and tip.hashes and event.parent is not None and tip.hashes[-1] == event.parent:
            tip.hashes.extend(event.hashes)
            tip.tokens.extend(ids)
        else:
            tip = self._tips[session] = _Tip(start, list(event.hashes), array("q", ids))
        drop = max(0, (len(tip.tokens) - TIP_TOKENS + size - 1) // size)
        drop = min(drop, len(tip.hashes) - 1)
        if drop > 0:
            del tip.hashes[:drop]
            del tip.tokens[: drop * size]
            tip.start += drop * size

    def session_tail(self, session: str) -> SessionTail | None:
        """The session's tip as far as the engine still holds it, block by block from its start; None when the
        index has none (its chain began before the subscription, or its first block is gone)."""
        tip = self._tips.get(session)
        size = self.block_size
        if tip is None or size is None:
            return None
        held = 0
        for block_hash in tip.hashes:
            if block_hash not in self._blocks:
                break
            held += 1
        return SessionTail(tip.start, tip.tokens[: held * size], size) if held else None

    def _put(
        self, block_hash: BlockHash, key: int | None, medium: int, session: str | None, depth: int, report: bool
    ) -> _Block:
        block = self._blocks.get(block_hash)
        if block is None:
            block = self._blocks[block_hash] = _Block(key, medium, None, depth)
        else:
            if block.media & medium and not report:
                extra = block.extra = block.extra or {}
                extra[medium] = extra.get(medium, 0) + 1
                self.counters.copies += 1
            block.media |= medium
            if depth >= 0:
                block.depth = depth
            if block.key != key:
                self._unkey(block_hash, block)
                block.key = key
            self._blocks.move_to_end(block_hash)
        if key is not None:
            self._by_key[key] = block_hash
        if session is not None and session != block.session:
            self._unsession(block)
            block.session = session
            self._sessions[session] = self._sessions.get(session, 0) + 1
        return block

    def _forget(self, block_hash: BlockHash, block: _Block) -> None:
        """A block left the index: its content key and its session's count go with it."""
        self._unkey(block_hash, block)
        self._unsession(block)
        self._set_lookahead(block, None)

    def _unkey(self, block_hash: BlockHash, block: _Block) -> None:
        if block.key is not None and self._by_key.get(block.key) == block_hash:
            del self._by_key[block.key]

    def _unsession(self, block: _Block) -> None:
        if block.session is None:
            return
        left = self._sessions[block.session] - 1
        if left:
            self._sessions[block.session] = left
        else:
            del self._sessions[block.session]
            self._tips.pop(block.session, None)
        block.session = None

    def session_blocks(self, session: str) -> int:
        """How many blocks this engine holds that `session`'s requests stored last."""
        return self._sessions.get(session, 0)

    def removed(self, event: Removed) -> None:
        if (event.group or 0) != self.group:
            return
        medium = _MEDIA.get(event.medium, _OTHER_MEDIUM)
        for i, block_hash in enumerate(event.hashes):
            block = self._blocks.get(block_hash)
            if block is None:
                self.counters.unknown_removed += 1
                continue
            left = _copies_left(block, medium, event.remaining[i] if event.remaining is not None else None)
            if left > 0:
                self.counters.copy_removed += 1
                continue
            block.media &= ~medium
            if block.media == 0:
                del self._blocks[block_hash]
                self._forget(block_hash, block)
                self.counters.removed += 1

    def cleared(self) -> None:
        self.counters.cleared += 1
        self.drop()

    def drop(self) -> None:
        """Forget everything (the counters stay)."""
        self.counters.dropped += len(self._blocks)
        self._blocks.clear()
        self._by_key.clear()
        self._sessions.clear()
        self._tips.clear()
        self._lookahead = 0

    def longest(self, prompt: PromptKeys) -> int:
        """How many leading whole blocks of the prompt this engine holds."""
        size = self.block_size
        if size is None:
            return 0
        held = self._keyed_run(prompt, size)
        return self._lookahead_held(prompt, held) if self._lookahead else held

    def _keyed_run(self, prompt: PromptKeys, size: int) -> int:
        """How many leading whole blocks of the prompt have their content key held."""
        by_key = self._by_key
        total = prompt.blocks(size)
        held = 0
        while held < total:
            keys = prompt.keys(size, held + max(_FIRST_KEYS, held // 2))
            for i in range(held, len(keys)):
                if keys[i] not in by_key:
                    return i
            held = len(keys)
        return held

    def _lookahead_held(self, prompt: PromptKeys, held: int) -> int:
        """Of `held` leading blocks matched by key, those the engine hits: each block hashed with a lookahead
        counts only if the prompt's tokens after it are that lookahead."""
        size = self.block_size or 1
        keys = prompt.keys(size, held)
        for i in range(held):
            lookahead = self._blocks[self._by_key[keys[i]]].lookahead
            if lookahead is not None and prompt.window((i + 1) * size, len(lookahead)) != lookahead:
                return i
        return held


@dataclass(frozen=True, slots=True)
class HeldPrefix:
    """The longest leading run of a prompt's blocks one worker holds, over its DP ranks."""

    worker: str
    tokens: int  # blocks * block size
    blocks: int
    rank: int | None  # the rank that holds it; None: nothing held


class KvIndex:
    """Every stream's index, by (worker, DP rank); a worker's lookups take its best rank."""

    def __init__(self, max_blocks_per_stream: int, group: int = 0) -> None:
        if max_blocks_per_stream < 1:
            raise ValueError("the KV index needs room for at least one block per stream")
        self._max = max_blocks_per_stream
        self._group = group
        self._streams: dict[str, dict[int, StreamIndex]] = {}
        self.counters = IndexCounters()

    def stream(self, worker: str, rank: int) -> StreamIndex:
        ranks = self._streams.setdefault(worker, {})
        found = ranks.get(rank)
        if found is None:
            found = ranks[rank] = StreamIndex(self._max, self._group, self.counters)
        return found

    def workers(self) -> list[str]:
        return sorted(self._streams)

    def blocks(self, worker: str | None = None) -> int:
        chosen = self._streams.values() if worker is None else [self._streams.get(worker, {})]
        return sum(len(index) for ranks in chosen for index in ranks.values())

    def drop(self, worker: str, rank: int | None = None) -> None:
        """Forget a worker (all its ranks) or one rank of it."""
        ranks = self._streams.get(worker, {})
        for r in [rank] if rank is not None else list(ranks):
            index = ranks.pop(r, None)
            if index is not None:
                index.drop()
        if not ranks:
            self._streams.pop(worker, None)

    def session_holders(self, session: str) -> dict[str, int]:
        """Per worker, the blocks `session` stored last that it still holds (its best rank); workers holding
        none are left out."""
        found = {}
        for worker, ranks in self._streams.items():
            blocks = max((index.session_blocks(session) for index in ranks.values()), default=0)
            if blocks:
                found[worker] = blocks
        return found

    def session_tokens(self, session: str) -> dict[str, int]:
        """Per worker, the tokens of the session's chain it holds (its best rank): the end of the session's tip
        where the index knows it (blocks other sessions stored first count; blocks of a branch the session left
        do not), else the blocks `session` stored last times the block size; workers holding none are left out."""
        found = {}
        for worker, ranks in self._streams.items():
            tokens = max((_session_tokens(index, session) for index in ranks.values()), default=0)
            if tokens:
                found[worker] = tokens
        return found

    def session_tail(self, worker: str, session: str) -> SessionTail | None:
        """The session's tip on `worker` (the rank whose tip reaches furthest), or None."""
        tails = [index.session_tail(session) for index in self._streams.get(worker, {}).values()]
        return max((t for t in tails if t is not None), key=lambda t: t.end, default=None)

    def longest_held_prefix(self, worker: str, token_ids: Sequence[int] | PromptKeys) -> HeldPrefix:
        prompt = token_ids if isinstance(token_ids, PromptKeys) else PromptKeys(token_ids)
        best = HeldPrefix(worker, 0, 0, None)
        for rank, index in sorted(self._streams.get(worker, {}).items()):
            blocks = index.longest(prompt)
            if blocks > best.blocks and index.block_size is not None:
                best = HeldPrefix(worker, blocks * index.block_size, blocks, rank)
        return best


def _copies_left(block: _Block, medium: int, remaining: int | None) -> int:
    """One copy of `block` on `medium` removed: how many are left there (`remaining`, where the engine says)."""
    if not block.media & medium:
        return 0
    extra = block.extra or {}
    left = remaining if remaining is not None else extra.get(medium, 0)
    if left > 1:
        extra[medium] = left - 1
    else:
        extra.pop(medium, None)
    block.extra = extra or None
    return left


def _session_tokens(index: StreamIndex, session: str) -> int:
    tail = index.session_tail(session)
    if tail is not None:
        return tail.end
    return index.session_blocks(session) * (index.block_size or 0)
