"""The multiturn suite's fronts (fronts.py): one shared Front per router; which fronts run a decider and whose
logs hold its bypass checks."""

from __future__ import annotations

from pathlib import Path

from loadtest.bench.fronts import Front
from loadtest.bench.suites.multiturn import fronts, replicas
from stack.procs import ManagedProcess, ProcessSpec


def router(name: str) -> Front:
    spec = ProcessSpec(name, ("true",), {}, Path(f"/logs/{name}.log"), "http://x/health", Path("/"))
    return Front("kvpush", "push", f"http://{name}", ManagedProcess(spec))


def test_every_kvpush_front_but_plain_kvpush_runs_the_decider() -> None:
    assert [fronts.has_decider(f) for f in ("kvpush", "kvpush-decider", replicas.REPLICAS, replicas.ESTIMATE)] == [
        False,
        True,
        True,
        True,
    ]
    assert not fronts.has_decider("vllm-router") and not fronts.has_decider(replicas.PEER_REPLICAS)
    assert not fronts.is_kvpush(replicas.PEER)


def test_a_decider_fronts_logs_are_its_routers_and_unstarted_routers_have_no_pid() -> None:
    routers = (router("r0"), router("r1"))
    assert fronts.decider_logs(replicas.REPLICAS, routers) == [Path("/logs/r0.log"), Path("/logs/r1.log")]
    assert fronts.decider_logs("kvpush", routers) == []
    assert fronts.pids(routers) == []
