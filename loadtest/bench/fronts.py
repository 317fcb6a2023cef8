"""A front door under test: the one name the suites use for a router they load (kvpush, vllm-router, or none)."""

from dataclasses import dataclass

from stack.procs import ManagedProcess


@dataclass(frozen=True)
class Front:
    """Which router, driving which transfer mode, at which URL; the process when a suite started it, and the
    prefill and decode behind it when the suite reads them (tokenizer, KV sources, leg order)."""

    router: str  # a row's `router`: kvpush, vllm-router, direct
    mode: str  # a row's `mode`: push, pull, direct
    base: str
    proc: ManagedProcess | None = None
    p_url: str | None = None
    d_url: str | None = None
    connector: str = "sim"  # a row's `connector` (cpu-vllm: the pair's family)
    tracing: str | None = None  # kvpush only: off, or the sample ratio of a traced router (overhead suite)
