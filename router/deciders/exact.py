"""What each worker's engine holds of a prompt, decided on the prompt's exact token ids and the engines' KV
events: the same answer on every router replica that follows the same events, fresh or warm. Pure.

The KV-event index (router/kv_events/index.py) keys every stored block by its chain of token ids, as vLLM
chains its block hashes (a block's hash covers its parent's and its own tokens), so the longest run of the
prompt's own blocks an engine reports is exactly the prefix its cache holds, whoever routed the requests that
stored it: a session's earlier turns, or another session's identical system prompt. A block hashed with more
than its tokens (LoRA, cache salt, multimodal input) matches nothing: never credited.

vLLM serves at most the prompt's whole blocks before its last token from the prefix cache (the last token is
always computed, so a prompt held whole recomputes its last block), which is what `cached` counts: the tokens
decode will not compute, exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.kv_events.view import KvEventView


@dataclass(frozen=True)
class ExactPick:
    decode: str | None  # the decode candidate holding the longest prefix (ties: the first); None: none holds any
    held: int  # the tokens of the prompt's leading whole blocks its engine holds
    cached: int  # of those, what its prefix cache serves for this prompt (whole blocks before the last token)
    uncached: int  # what it computes: the prompt's tokens less `cached`
    prefill: str | None  # the prefill candidate holding the longest prefix; None: none holds any, or not known


def served_from_cache(held: int, prompt: int, block: int) -> int:
    """The tokens vLLM's prefix cache serves of a `prompt`-token prompt whose first `held` tokens (whole blocks of
    `block` tokens) it holds: never the last prompt token's block."""
    if prompt <= 0 or block <= 0:
        return 0
    return min(held, ((prompt - 1) // block) * block)


def exact_pick(
    view: KvEventView, ids: Sequence[int], decode: Sequence[str], prefill: Sequence[str]
) -> ExactPick | None:
    """The pick for a prompt of `ids` among the candidates (in configuration order); None when a decode
    candidate's KV-event view is not caught up (it may hold more than its events say: the caller estimates)."""
    if not decode or not all(view.caught_up(worker) for worker in decode):
        return None
    up = [worker for worker in prefill if view.caught_up(worker)]
    found = view.held_prefixes(ids, [*decode, *up])
    best, held, cached = None, 0, 0
    for worker in decode:
        prefix = found[worker]
        block = prefix.tokens // prefix.blocks if prefix.blocks else 0
        serves = served_from_cache(prefix.tokens, len(ids), block)
        if prefix.tokens > held:
            best, held, cached = worker, prefix.tokens, serves
    warm = max(up, key=lambda worker: found[worker].tokens, default=None)
    if warm is not None and (found[warm].tokens == 0 or len(up) < len(prefill)):
        warm = None  # nothing held, or a prefill whose view lags might hold more
    return ExactPick(best, held, cached, len(ids) - cached, warm)
