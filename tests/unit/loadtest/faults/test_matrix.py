"""How the matrix lays a run out (no sockets, no processes): the table's form runs one bed at a time with the
connector's default lease; the test's form runs the stand-in rows while the vLLM bed starts, with a shorter lease;
both give every row's result in the rows' order."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from loadtest.faults import matrix
from loadtest.faults.bed import KV_TIMEOUT_S, PREEMPT_SHAPE, BedShape
from loadtest.faults.rows import FaultRow
from stack.link.access import LinkUnavailable

ROWS = (
    FaultRow("s1", "prefill", "status500", "standin", 5.0, "-"),
    FaultRow("v1", "client", "burst", "vllm", 5.0, "-"),
    FaultRow("s2", "decode", "status500", "standin", 5.0, "-"),
    FaultRow("v2", "prefill", "kill", "vllm", 5.0, "-"),
)


class Fake:
    """Beds and rows that record what happened in which order; a stand-in row waits (bounded) for the vLLM bed
    to be entered when `standin_waits` is set, so overlapping is observable without timing anything."""

    def __init__(self, standin_waits: bool) -> None:
        self.events: list[str] = []
        self.leases: list[tuple[float | None, float]] = []  # (P's lease, D's hold deadline) of each vLLM bed
        self.vllm_entered = threading.Event()
        self.standin_waits = standin_waits

    @contextlib.contextmanager
    def standin_bed(self, *args: Any, **kwargs: Any) -> Iterator[str]:
        yield "standin"

    @contextlib.contextmanager
    def vllm_bed(
        self,
        config: Mapping[str, Any],
        lease_s: float | None = None,
        kv_timeout_s: float = KV_TIMEOUT_S,
        shape: BedShape | None = None,
    ) -> Iterator[str]:
        self.leases.append((lease_s, kv_timeout_s))
        label = (shape or BedShape()).label
        self.events.append("vllm bed" if label == "faults" else f"vllm bed {label}")
        self.vllm_entered.set()
        yield "vllm"

    def run_row(self, bed: Any, row: FaultRow) -> matrix.RowResult:
        if bed == "standin" and self.standin_waits:
            assert self.vllm_entered.wait(30.0), "the stand-in row ran without the vLLM bed starting"
        self.events.append(row.name)
        return matrix.RowResult({"name": row.name}, {}, {}, clean=True, within_deadline=True)


def patched(monkeypatch: pytest.MonkeyPatch, fake: Fake) -> None:
    monkeypatch.setattr(matrix, "standin_bed", fake.standin_bed)
    monkeypatch.setattr(matrix, "vllm_bed", fake.vllm_bed)
    monkeypatch.setattr(matrix, "run_row", fake.run_row)


def test_the_table_form_runs_the_stand_in_rows_first_then_the_vllm_bed_with_the_default_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = Fake(standin_waits=False)
    patched(monkeypatch, fake)
    results = matrix.run(ROWS)
    assert [r.row["name"] for r in results] == ["s1", "v1", "s2", "v2"]
    assert fake.events == ["s1", "s2", "vllm bed", "v1", "v2"]
    assert fake.leases == [(None, KV_TIMEOUT_S)]


def test_the_test_form_runs_the_stand_in_rows_while_the_vllm_bed_starts_with_a_shorter_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = Fake(standin_waits=True)
    patched(monkeypatch, fake)
    results = matrix.run(ROWS, form=matrix.TEST_FORM)
    assert [r.row["name"] for r in results] == ["s1", "v1", "s2", "v2"]
    assert fake.events[0] == "vllm bed" and sorted(fake.events[1:]) == ["s1", "s2", "v1", "v2"]
    lease, hold = matrix.TEST_FORM.lease_s, matrix.TEST_FORM.kv_timeout_s
    assert fake.leases == [(lease, hold)] and lease is not None and lease < 30.0 and hold < KV_TIMEOUT_S


def test_the_test_form_without_vllm_rows_runs_the_stand_ins_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Fake(standin_waits=False)
    patched(monkeypatch, fake)
    results = matrix.run([r for r in ROWS if r.bed == "standin"], form=matrix.TEST_FORM)
    assert [r.row["name"] for r in results] == ["s1", "s2"] and fake.leases == []


def test_each_vllm_bed_runs_only_its_own_rows_one_bed_after_the_other(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Fake(standin_waits=False)
    patched(monkeypatch, fake)
    preempt = FaultRow("p1", "prefill", "preempt-under-load", "vllm-preempt", 5.0, "-")
    results = matrix.run([preempt, *ROWS])
    assert [r.row["name"] for r in results] == ["p1", "s1", "v1", "s2", "v2"]
    assert fake.events == ["s1", "s2", "vllm bed", "v1", "v2", f"vllm bed {PREEMPT_SHAPE.label}", "p1"]
    assert PREEMPT_SHAPE.routed == (1,), "the single instance (p0) stays out of the router"


def test_a_bed_this_machine_cannot_make_leaves_its_rows_unclean_with_the_reason_and_the_rest_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = Fake(standin_waits=False)
    patched(monkeypatch, fake)
    real = fake.vllm_bed

    @contextlib.contextmanager
    def no_link(*args: Any, **kwargs: Any) -> Iterator[str]:
        shape = args[3] if len(args) > 3 else kwargs.get("shape")
        if shape is not None and shape.link:
            raise LinkUnavailable("no namespaces here")
        with real(*args, **kwargs) as bed:
            yield bed

    monkeypatch.setattr(matrix, "vllm_bed", no_link)
    cut = FaultRow("l1", "prefill", "link-cut", "vllm-link", 5.0, "-")
    results = {r.row["name"]: r for r in matrix.run([*ROWS, cut])}
    assert results["l1"].outcome["summary"] == "not run: no namespaces here" and not results["l1"].clean
    assert all(results[name].clean for name in ("s1", "v1", "s2", "v2"))
