"""A suite's children start with a fixed address-space layout inside `fixed_layout()` (ASLR off: every start of
a program maps its heap at the same address), and with the kernel's random one again after it."""

from __future__ import annotations

import ctypes
import subprocess

import pytest

from loadtest.bench import aslr
from loadtest.bench.aslr import fixed_layout, is_fixed


def _heap() -> str:
    """Where a fresh child's heap starts."""
    maps = subprocess.run(["cat", "/proc/self/maps"], capture_output=True, text=True, check=True, timeout=10).stdout
    return next(line.split("-")[0] for line in maps.splitlines() if line.endswith("[heap]"))


def test_children_started_in_the_block_share_one_layout() -> None:
    before = is_fixed()  # False but under `setarch -R`
    with fixed_layout() as fixed:
        if not fixed:
            pytest.skip("this kernel refuses ADDR_NO_RANDOMIZE (a seccomp filter): nothing to check here")
        assert is_fixed()
        assert len({_heap() for _ in range(3)}) == 1
    assert is_fixed() == before
    if not before:
        assert len({_heap() for _ in range(3)}) > 1  # random again (three equal draws of 28 bits or more: never)


class _Refusing:
    """libc whose personality() reads but refuses every change, as under a seccomp filter that allows reads."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def personality(self, persona: ctypes.c_ulong) -> int:
        value = int(persona.value)
        self.calls.append(value)
        return 0 if value == aslr._QUERY else -1


def test_a_refused_setting_is_reported_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _Refusing()
    monkeypatch.setattr(aslr, "_libc", lambda: libc)
    with fixed_layout() as fixed:
        assert not fixed
    assert libc.calls[-1] == 0  # the persona read first is put back
