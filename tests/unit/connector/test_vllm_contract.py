"""connector.plugin against what each supported vLLM (0.32-0.34) asks of a connector class, beyond the step hooks.

- ``handle_preemptions`` (0.32-0.34, both model runners call it before the forward): a P leg vLLM preempted has
  its blocks freed already; the call returns only once no WRITE of it is in flight (guarantee G2 on P's side).
- ``supports_sleep_mode`` (0.33+): refused, sleep would remap the KV memory under our NIXL registrations.
- ``kv_cache_access`` (0.34, the extensible KV cache): NIXL registers the device cache and same-host peers map it
  through cuda_ipc, so each range must be one physical allocation; a host cache asks nothing.

Runs in ``make test`` on 0.32 and in ``make compat VLLM=...`` on every other supported version.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="connector.plugin is the class vLLM loads")

from connector.plugin import KvpushConnector, KvpushMetadata
from connector.wire.plan import PrefillPreempted, PrefillProgress, StepPlan
from connector.worker import WorkerHalf
from tests.unit.connector.test_transfer_thread import Side, register, wait_for

KEY = "t:1"


def _prefill_connector(p: Side) -> KvpushConnector:
    worker = WorkerHalf.__new__(WorkerHalf)  # no KV caches needed: the fence goes to the transfer thread
    worker._thread = p.thread
    conn = KvpushConnector.__new__(KvpushConnector)
    conn._worker, conn._scheduler = worker, None
    return conn


def test_handle_preemptions_returns_only_once_the_preempted_legs_write_is_over(pair: tuple[Side, Side]) -> None:
    p, d = pair
    p.backend.polls_before_done = 40
    register(p, d, blocks=(4, 5, 6))
    wait_for(lambda: KEY in p.thread._prefill.entries)
    p.thread.submit(PrefillProgress("p1", KEY, (1,), 3, 0))
    wait_for(lambda: p.backend.in_flight_to("agent-D") == 1)
    plan = StepPlan(preempted=[PrefillPreempted("p1", KEY)])
    _prefill_connector(p).handle_preemptions(KvpushMetadata(plan))
    assert p.backend.in_flight_to("agent-D") == 0, "the forward would overwrite blocks a WRITE still reads"


def test_handle_preemptions_without_a_preempted_leg_does_not_wait(pair: tuple[Side, Side]) -> None:
    p, _ = pair
    _prefill_connector(p).handle_preemptions(KvpushMetadata(StepPlan()))
    assert p.collect().counters["fenced"] == 0


def test_sleep_mode_is_refused() -> None:
    assert KvpushConnector.supports_sleep_mode(SimpleNamespace(kv_buffer_device="cuda")) is False


def test_the_kv_cache_access_asks_for_one_physical_allocation_per_registered_range() -> None:
    kv_transfer = pytest.importorskip("vllm.config.kv_transfer")
    access = getattr(kv_transfer, "KVCacheAccess", None)
    if access is None:
        pytest.skip("this vLLM has no extensible KV cache (< 0.34): nothing to declare")
    device = KvpushConnector.kv_cache_access(SimpleNamespace(kv_buffer_device="cuda"))
    assert device == access.REGISTERS | access.EXPORTS_FABRIC and device.needs_single_chunk()
    assert KvpushConnector.kv_cache_access(SimpleNamespace(kv_buffer_device="cpu")) == access.IN_PROCESS
