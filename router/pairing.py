"""Whether a prefill and a decode server can be paired for push, from what their /metrics say. Pure.

Upstream push (vLLM 0.34, `NixlPushConnector`) requires equal KV block sizes on both sides and refuses a pair
that differs only at the NIXL handshake, inside the engines: the client sees a failed or hung request, the
operator a stack trace in a worker log. vLLM 0.33 still wrote through a block-size ratio. When the router knows
both block sizes (`rank_metrics.block_size` from each server's `vllm:cache_config_info`), it refuses such a pair
before either leg leaves, with a message that says what to change. Unknown sizes are not refused: the router
cannot know, and the engines still check.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockSizes", "block_size_mismatch"]


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
