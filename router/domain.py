"""Value types shared by the router's modules: roles, modes, endpoints, workers, request facts, the sleep seam.

No I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

Sleep = Callable[[float], Awaitable[None]]  # asyncio.sleep, or a test's fake clock's


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class Mode(enum.StrEnum):
    PUSH = "push"  # both legs at once; prefill WRITEs the KV into decode's blocks
    PULL = "pull"  # prefill first, then decode READs with the params prefill returned


class Fallback(enum.StrEnum):
    """What the router does when no prefill worker is usable."""

    NONE = "none"  # answer 503
    DECODE_ONLY = "decode-only"  # decode computes the prompt itself


class Endpoint(enum.StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"
    MESSAGES = "messages"  # Anthropic's Messages API (vLLM serves it as chat)
    RESPONSES = "responses"  # OpenAI's Responses API

    @property
    def path(self) -> str:
        return _PATHS[self]

    @property
    def openai_choices(self) -> bool:
        """An OpenAI completions-shaped API (`choices`, `n`, `usage.prompt_tokens_details`)."""
        return self in (Endpoint.COMPLETIONS, Endpoint.CHAT)


_PATHS = {
    Endpoint.COMPLETIONS: "/v1/completions",
    Endpoint.CHAT: "/v1/chat/completions",
    Endpoint.MESSAGES: "/v1/messages",
    Endpoint.RESPONSES: "/v1/responses",
}


class ConnectorKind(enum.StrEnum):
    """Which KV connector a prefill server runs: it decides where the side channels of its DP ranks listen."""

    NIXL = "nixl"  # vLLM's NixlConnector / NixlPushConnector: one side channel per DP engine, base port + DP index
    KVPUSH = "kvpush"  # kvpush's connector: one per worker rank, base + DP index x TP x PP (+ the rank's offset)


@dataclass(frozen=True)
class NixlIdentity:
    """What a decode instance must know about a prefill instance to register with it (push mode).
    `tp_known`: False when a learned identity came from an answer that did not state `tp_size` (1 assumed)."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1
    connector: ConnectorKind = ConnectorKind.NIXL
    tp_known: bool = True


@dataclass(frozen=True)
class WorkerSpec:
    """A configured worker. For prefill workers `identity` is None when it is learned ("auto"). `dp_size`: the
    server's data-parallel ranks (`--data-parallel-size`); with more than one, `identity` is the server's base
    identity (the engine id and side port vLLM was started with) and each rank's is derived
    (router/workers/ranks.py)."""

    url: str
    role: Role
    identity: NixlIdentity | None = None
    dp_size: int = 1
    tp_size: int | None = None  # decode: its tensor-parallel size when configured (None: unknown)

    @property
    def id(self) -> str:
        return self.url


@dataclass(frozen=True)
class EngineLoad:
    """A worker's own load as its vLLM /metrics last said (summed over its engines)."""

    running: int
    waiting: int
    kv_usage: float  # 0..1


@dataclass(frozen=True)
class WorkerView:
    """A snapshot of one worker's load, as selection policies see it."""

    id: str
    in_flight: int  # legs in flight through this router
    outstanding_tokens: int  # prompt tokens of those legs
    engine_running: int = 0  # from the last scrape, when load_known
    engine_waiting: int = 0
    kv_usage: float = 0.0
    load_known: bool = False


@dataclass(frozen=True)
class RequestInfo:
    """The facts about a client request that selection may use."""

    endpoint: Endpoint
    stream: bool
    prompt_tokens: int  # an estimate when the prompt is text
