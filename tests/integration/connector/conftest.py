"""The one vLLM family of this package (our connector everywhere), started once for all its modules.

p0 is a plain prefill, p1 a chunked one (2 tokens a step: a 1850-token prompt stays in prefill for about
900 steps, seconds even on a fast machine, so a test can act while it runs), d the decode.
`test_router_kvpush.py` kills p1 in its last test; every other test uses p0 and d only.
An exclusive file lock keeps other vLLM families of the same test run off the two cores meanwhile.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator

import pytest

from tests.integration.connector.kvpush_support import Engines, Member, kvpush_engines
from tests.integration.vllm_support import CACHE, require_vllm

CHUNKED = ("--max-num-batched-tokens", "2", "--max-num-seqs", "2")


@pytest.fixture(scope="package")
def kvpush_family() -> Iterator[Engines]:
    require_vllm()
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "vllm-pair.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        members = [Member("prefill"), Member("prefill", CHUNKED), Member("decode")]
        with kvpush_engines(members, tag="kvp") as engines:
            yield engines
