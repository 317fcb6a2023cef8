"""Fixed address-space layout for the processes a suite starts: Linux's ADDR_NO_RANDOMIZE personality.

Why: two identical routers started apart differed by 5-13 % in CPU per request for the life of each process
(bench/ANALYSIS.md, "tracing overhead with an A/A control"), more than the effects the overhead suite measures;
a fixed `PYTHONHASHSEED` and pinning to a core did not remove it. Where a process's heap, stacks and libraries sit
decides which of its hot objects share cache sets, so every start draws a new cost. With the layout fixed, every
start of the same program lands the same way (runs 20261206T195359Z and 20261206T200313Z, ANALYSIS.md).

`fixed_layout()` sets the personality of this process for the block: the flag takes effect at `exec`, so it holds
for every child started meanwhile, not for this process. Where the kernel refuses (a seccomp filter), nothing is
changed and the block says so (`False`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator

ADDR_NO_RANDOMIZE = 0x0040000  # <linux/personality.h>
_QUERY = 0xFFFFFFFF  # personality(0xffffffff) reads the current persona and changes nothing


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name, use_errno=True)


@contextlib.contextmanager
def fixed_layout() -> Iterator[bool]:
    """Children started in the block run with ASLR off; yields whether the kernel took the setting."""
    libc = _libc()
    before = -1 if libc is None else int(libc.personality(ctypes.c_ulong(_QUERY)))
    if libc is None or before < 0:
        yield False
        return
    took = int(libc.personality(ctypes.c_ulong(before | ADDR_NO_RANDOMIZE))) >= 0
    try:
        yield took and is_fixed()  # read back: a filter may answer "done" (errno 0) without doing it
    finally:
        libc.personality(ctypes.c_ulong(before))


def is_fixed() -> bool:
    """Whether children started now get a fixed layout (this process's persona has ADDR_NO_RANDOMIZE)."""
    libc = _libc()
    if libc is None:
        return False
    persona = int(libc.personality(ctypes.c_ulong(_QUERY)))
    return persona >= 0 and bool(persona & ADDR_NO_RANDOMIZE)
