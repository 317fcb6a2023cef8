"""Whether a prefill and a decode server can be paired for push, from what their /metrics say. Pure.

Upstream push (vLLM 0.34, `NixlPushConnector`) requires equal KV block sizes on both sides and refuses a pair
that differs only at the NIXL handshake, inside the engines: the client sees a failed or hung request, the
operator a stack trace in a worker log. vLLM 0.33 still wrote through a block-size ratio. When the router knows
both block sizes (`rank_metrics.block_size` from each server's `vllm:cache_config_info`), it refuses such a pair
before either leg leaves, with a message that says what to change. Unknown sizes are not refused: the router
cannot know, and the engines still check.

Parallelism (`parallelism_mismatch`): the decode leg carries the chosen prefill's `tp_size`/`pp_size`
(configured, or as its answer stated them). When decode's TP is configured (`tp=N` on the decode worker), the
router refuses a pair whose TP sizes neither divides the other (neither connector splits heads across such a
pair), and a prefill that never stated its TP (the decode leg would tell decode "tp 1" on a guess) while decode
runs TP > 1. A pipeline-parallel decode is refused when the worker is configured (`router.workers.specs`); a
pipeline-parallel prefill is fine (each stage writes its layers; decode is told `pp_size`). Unknown TP on
decode is not refused: the engines check
(kvpush's connector refuses a pair it cannot split per request, at once).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.domain import NixlIdentity

__all__ = ["BlockSizes", "block_size_mismatch", "parallelism_mismatch"]


@dataclass(frozen=True)
class BlockSizes:
    """The block sizes the router last read from each side (None: not known yet or not stated)."""

    prefill: int | None
    decode: int | None


def block_size_mismatch(sizes: BlockSizes) -> str | None:
    """Why a prefill and a decode server with these block sizes cannot be paired, or None when they can or when
    the router cannot tell. The message names no worker (clients read it; the caller logs which pair)."""
    if sizes.prefill is None or sizes.decode is None or sizes.prefill == sizes.decode:
        return None
    return (
        f"the prefill runs KV block size {sizes.prefill} but the decode runs {sizes.decode}: push needs equal block "
        "sizes on both sides (vLLM 0.34 refuses the pair at the NIXL handshake); start both with the same "
        "--block-size"
    )


def parallelism_mismatch(prefill: NixlIdentity, decode_tp: int | None) -> str | None:
    """Why the decode leg cannot be told to pair with this prefill identity, or None when it can or when the
    router cannot tell (decode's TP not configured). Names no worker (clients read it)."""
    if decode_tp is None:
        return None
    if not prefill.tp_known and decode_tp > 1:
        return (
            f"the prefill did not state its tensor-parallel size and the decode runs tensor_parallel_size {decode_tp}: "
            "configure the prefill worker's tp (and engine_id/side_port) so the decode can find its ranks"
        )
    p_tp = prefill.tp_size
    if p_tp % decode_tp and decode_tp % p_tp:
        return (
            f"the prefill runs tensor_parallel_size {p_tp} and the decode {decode_tp}: push splits KV heads only "
            "when one size divides the other"
        )
    return None
