"""vLLM's OpenAI wire format as the simulator speaks it: request parsing, KV params, SSE chunks, /metrics text."""

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loadtest.sim.engine import LegKind

TOKEN_TEXT = " x"


@dataclass(frozen=True)
class Incoming:
    """What the engine needs from a completions/chat body."""

    chat: bool
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    kind: LegKind
    kv: Mapping[str, Any]


def count_prompt(body: Mapping[str, Any], chat: bool) -> int:
    """Word-count tokens (the synthetic tokenizer); token-id lists count their length."""
    if chat:
        msgs = body.get("messages") or []
        return sum(len(str(m.get("content") or "").split()) for m in msgs if isinstance(m, dict))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return len(prompt)
        prompt = prompt[0] if prompt else ""
    return len(str(prompt).split())  # the word tokenizer's count, without building the ids


def kind_of(kv: Mapping[str, Any]) -> LegKind:
    if kv.get("do_remote_decode"):
        return LegKind.PREFILL
    if kv.get("do_remote_prefill"):
        return LegKind.PULL if kv.get("remote_block_ids") else LegKind.PUSH
    return LegKind.LOCAL


def parse(body: Mapping[str, Any], chat: bool) -> Incoming:
    kv = body.get("kv_transfer_params") or {}
    if not isinstance(kv, dict):
        raise ValueError("kv_transfer_params must be an object")
    kind = kind_of(kv)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    if kind is LegKind.PREFILL:
        max_tokens = 1
    opts = body.get("stream_options") or {}
    return Incoming(
        chat=chat,
        prompt_tokens=max(count_prompt(body, chat), 1),
        max_tokens=int(max_tokens),
        stream=bool(body.get("stream", False)),
        include_usage=bool(opts.get("include_usage", False)) if isinstance(opts, dict) else False,
        kind=kind,
        kv=kv,
    )


def handoff_key(kv: Mapping[str, Any], request_id: str) -> str:
    """How P and D name one handoff: the transfer id when the router sent one, else the request id."""
    return str(kv.get("transfer_id") or kv.get("remote_request_id") or request_id)


def prefill_kv_params(
    engine_id: str, host: str, port: int, key: str, prompt_tokens: int, num_blocks: int, kv_mode: str
) -> dict[str, Any]:
    """What P returns to the router: enough for a pull D to READ, and P's identity for push.

    kv_mode is the connector the simulated P runs: "pull" or "push" (stated as transfer_mode, so a router in
    the other mode can refuse the pair) or "both" (no transfer_mode stated).
    """
    out: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": list(range(num_blocks)),
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": key,
        "tp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": prompt_tokens,
        "transfer_mode": kv_mode,
        "transfer_id": key,
    }
    if kv_mode == "push":
        del out["remote_block_ids"]
    if kv_mode == "both":
        del out["transfer_mode"]
    return out


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chunk(rid: str, model: str, chat: bool, first: bool, final: bool) -> bytes:
    finish = "length" if final else None
    if chat:
        delta: dict[str, str] = {"content": TOKEN_TEXT}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": TOKEN_TEXT, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    ev = {"id": f"cmpl-{rid}", "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    return b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"


def usage_chunk(rid: str, model: str, chat: bool, prompt: int, completion: int) -> bytes:
    obj = "chat.completion.chunk" if chat else "text_completion"
    ev = {"id": f"cmpl-{rid}", "object": obj, "model": model, "choices": [], "usage": usage(prompt, completion)}
    return b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def full_response(
    rid: str, model: str, chat: bool, prompt: int, completion: int, kv: Mapping[str, Any] | None
) -> dict[str, Any]:
    text = TOKEN_TEXT * completion
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    choice["finish_reason"] = "length"
    out: dict[str, Any] = {
        "id": f"cmpl-{rid}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(prompt, completion),
    }
    if kv is not None:
        out["kv_transfer_params"] = dict(kv)
    return out


def metrics_text(
    model: str,
    running: int,
    waiting: int,
    kv_usage: float,
    by_source: Mapping[str, int],
    success: int,
    loop: Mapping[str, float] | None = None,
) -> str:
    """vLLM's gauges and counters the benches read, plus the simulator's own loop counters (kvpush_sim_*)."""
    lab = f'engine="0",model_name="{model}"'
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{lab}}} {running}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{lab}}} {waiting}",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{lab}}} {kv_usage}",
        "# TYPE vllm:prompt_tokens_by_source_total counter",
    ]
    for src in ("local_compute", "external_kv_transfer", "local_cache_hit"):
        lines.append(f'vllm:prompt_tokens_by_source_total{{{lab},source="{src}"}} {float(by_source.get(src, 0))}')
    lines += ["# TYPE vllm:request_success_total counter", f"vllm:request_success_total{{{lab}}} {float(success)}"]
    for key, value in (loop or {}).items():
        lines += [f"# TYPE kvpush_sim_{key} counter", f"kvpush_sim_{key} {float(value)}"]
    return "\n".join(lines) + "\n"
