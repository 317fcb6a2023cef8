"""The multiturn suite's plan: the sessions, the engines, the fronts a run takes in turn, and the decider's block."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest import multiturn
from loadtest.bench.suites.multiturn import replicas as replicas_mod
from stack.engines import KV_EVENT_OFFSETS
from stack.family import PdFamily, pd_family
from stack.link import bypass
from stack.link.plan import LinkPlan, preset

DETAILS = "--enable-prompt-tokens-details"
CONNECTORS = {"upstream-push": ("NixlPushConnector", None), "kvpush-push": ("KvpushConnector", "connector.plugin")}
FRONTS = ("kvpush", "kvpush-decider", "vllm-router")  # the first one is the answers' reference


@dataclass(frozen=True)
class MultiTurnPlan:
    sessions: int
    session_rate: float  # sessions started per second (Poisson)
    turns_min: int = 6
    turns_max: int = 10
    message_min: int = 50  # tokens of each turn's new message
    message_max: int = 500
    answer_min: int = 32
    answer_max: int = 128
    think_s: float = 2.0  # mean think time between turns (exponential)
    system_tokens: int = 0
    system_shared: bool = False  # every session opens with the same system prompt (system_tokens of it)
    seed: int = 11
    connector: str = "kvpush-push"  # the product's connector on the three engines; or "upstream-push"
    model_size: str = "bench"
    max_model_len: int = 8192  # ten turns of up to 500 + 128 tokens
    decider_options: tuple[tuple[str, float], ...] = ()  # e.g. (("bypass_max_uncached_tokens", 256),)
    vrouter_decode_policy: str = "consistent_hash"
    timeout_s: float = 300.0
    repeats: int = 2  # each with new sessions (seed + repeat); odd repeats take the fronts in reverse order
    warmup_sessions: int = 4  # short 2-turn sessions through every front first (P-D handshakes, first shapes)
    link: str = ""  # a stack.link preset (ethernet-25g-like, ...): engines in namespaces behind a shaped link
    link_calibrate_tokens: int = 1024  # the prompt P's prefill is timed on to resolve the preset's rate
    replicas: int = 1  # 2-4: the KV-event fronts, one of them behind this many router replicas (replicas.py)
    events_off_row: bool = True  # with replicas: the decider with events off too
    answer_tokenizer: bool = True  # the KV-event fronts' decider gets the model's tokenizer (option `tokenizer`):
    # it decides on the prompts' exact token ids (issue 40; docs/multi-turn.md, "The exact path")
    api: str = "chat"  # "chat" | "completions" | "both" (even sessions chat, odd ones completions)
    burst: int = 1  # sessions arrive in groups of this many at once
    peer_kv_aware: bool = False  # with replicas: vllm-router's kv_aware on one and on `replicas` routers too
    estimate_row: bool = False  # with replicas: one events router without the tokenizer (CPU on / off)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("multiturn repeats: at least 1")
        if self.link:
            preset(self.link)  # ValueError naming the known presets
        if not 1 <= self.replicas <= 4:
            raise ValueError("multiturn replicas: 1 to 4")

    @property
    def suite(self) -> str:
        """The rows' suite: "multiturn-replicas" with replicas (on a link too: its rows carry the link's record),
        else "multiturn-link" on a link, else "multiturn" (the loopback section stays as it is)."""
        return "multiturn-replicas" if self.replicas > 1 else "multiturn-link" if self.link else "multiturn"

    @property
    def fronts(self) -> tuple[str, ...]:
        """The fronts in the order of even repeats; the first is the answers' reference."""
        if self.replicas < 2:
            return FRONTS
        return replicas_mod.fronts(self.replicas, self.events_off_row, self.peer_kv_aware, self.estimate_row)

    def shape(self, repeat: int = 0) -> multiturn.SessionShape:
        return multiturn.SessionShape(
            sessions=self.sessions,
            session_rate=self.session_rate,
            turns=(self.turns_min, self.turns_max),
            message_tokens=(self.message_min, self.message_max),
            answer_tokens=(self.answer_min, self.answer_max),
            think_s=self.think_s,
            system_tokens=self.system_tokens,
            seed=self.seed + repeat,
            system_shared=self.system_shared,
            api=self.api,
            burst=self.burst,
        )


FULL = MultiTurnPlan(sessions=24, session_rate=0.2)
SMOKE = MultiTurnPlan(
    sessions=2,
    session_rate=1.0,
    turns_min=2,
    turns_max=3,
    message_min=40,
    message_max=120,
    answer_min=8,
    answer_max=16,
    think_s=0.2,
    model_size="tiny",
    max_model_len=2048,
    timeout_s=120.0,
    repeats=1,
    warmup_sessions=0,
)


def engine_family(plan: MultiTurnPlan, model: Path) -> PdFamily:
    """mt-p0 on core 0, mt-d0 and mt-d1 sharing core 1, all on the plan's connector."""
    connector, module = CONNECTORS[plan.connector]
    return pd_family(
        "mt",
        model,
        connector,
        module=module,
        n_decode=2,
        extra_args=(DETAILS,),
        max_model_len=plan.max_model_len,
        kv_events=KV_EVENT_OFFSETS if plan.replicas > 1 else None,
    )


def on_link(plan: MultiTurnPlan, link: LinkPlan) -> MultiTurnPlan:
    """`plan` with the decider's bypass threshold derived from the calibrated link (stack.link.bypass), unless
    the plan set one by hand."""
    options = bypass.decider_options(plan.decider_options, link, plan.link_calibrate_tokens)
    return replace(plan, decider_options=options)


def decider_yaml(plan: MultiTurnPlan, block_tokens: int | None = None, tokenizer: Path | None = None) -> str:
    """The router's decider block; the engines' block size unless the plan sets one; `tokenizer`: the model's
    directory (its tokenizer.json), for a decider that follows KV events."""
    options = dict(plan.decider_options)
    if block_tokens is not None:
        options.setdefault("block_tokens", block_tokens)
    lines = ["decider:", "  name: session-affinity"] + [f"  {k}: {v:g}" for k, v in options.items()]
    lines += [f"  tokenizer: {json.dumps(str(tokenizer))}"] if tokenizer is not None else []
    return "\n".join(lines) + "\n"


def warmup(plan: MultiTurnPlan) -> list[multiturn.Session]:
    """Sessions that warm every front before the first measured one (the first push to each decode pays its NIXL
    handshake with the prefill, and the first front would pay it alone); their ids never meet a measured one's."""
    shape = multiturn.SessionShape(
        sessions=plan.warmup_sessions,
        session_rate=10.0,
        turns=(2, 2),
        message_tokens=(plan.message_min, plan.message_min),
        answer_tokens=(plan.answer_min, plan.answer_min),
        think_s=0.0,
        seed=plan.seed + 1000,
    )
    return multiturn.plan_sessions(shape)
