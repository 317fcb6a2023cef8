"""Discovery sources driven without sockets: DNS through a fake resolver, Kubernetes through httpx.MockTransport."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.discovery.base import StaticSource
from router.discovery.build import build_source
from router.discovery.dns import DnsSource, LookupFailed
from router.discovery.kubernetes import KubeApi, KubernetesSource
from router.discovery.settings import DnsConfig, KubernetesConfig, StaticConfig, in_cluster_api_url
from router.domain import Role, WorkerSpec
from router.errors import ConfigError
from router.metrics import Metrics
from router.pool import Pool


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[Role, list[str]]] = []

    def set_members(self, role: Role, specs: Sequence[WorkerSpec]) -> None:
        self.calls.append((role, [s.url for s in specs]))

    @property
    def urls(self) -> list[list[str]]:
        return [urls for _, urls in self.calls]


class Stop(BaseException):
    """Ends a source's loop in a test. Not an Exception: the sources survive every Exception."""


class Sleeps:
    """Records the delays asked for; ends the source's loop on the `rounds`-th sleep."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        if len(self.delays) >= self.rounds:
            raise Stop


class ScriptedResolver:
    def __init__(self, *answers: frozenset[str] | Exception) -> None:
        self.answers = list(answers)

    async def addresses(self, name: str) -> frozenset[str]:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_dns_source_publishes_changes_only_and_keeps_the_last_set_when_lookups_fail() -> None:
    resolver = ScriptedResolver(
        frozenset({"10.0.0.2", "10.0.0.1"}),
        frozenset({"10.0.0.1", "10.0.0.2"}),
        LookupFailed("SERVFAIL"),
        frozenset({"10.0.0.1"}),
        frozenset(),
        frozenset({"fd00::1"}),
    )
    errors: list[tuple[Role, str]] = []
    sleeps = Sleeps(rounds=6)
    source = DnsSource(
        Role.DECODE,
        "d.test",
        8000,
        interval=3.0,
        timeout=1.0,
        resolver=resolver,
        on_error=lambda role, reason: errors.append((role, reason)),
        sleep=sleeps,
    )
    sink = Sink()
    with pytest.raises(Stop):
        await source.run(sink)
    assert sink.urls == [
        ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
        ["http://10.0.0.1:8000"],  # the failed lookup in between changed nothing
        [],  # no records: an empty pool
        ["http://[fd00::1]:8000"],
    ]
    assert all(role is Role.DECODE for role, _ in sink.calls)
    assert errors == [(Role.DECODE, "SERVFAIL")] and source.errors == 1
    assert sleeps.delays == [3.0] * 6


async def test_dns_source_counts_a_resolver_that_hangs_past_its_deadline() -> None:
    class Hangs:
        async def addresses(self, name: str) -> frozenset[str]:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    source = DnsSource(Role.PREFILL, "p.test", 1, interval=1.0, timeout=0.01, resolver=Hangs(), sleep=Sleeps(1))
    sink = Sink()
    with pytest.raises(Stop):
        await source.run(sink)
    assert source.errors == 1 and sink.calls == []


async def test_dns_source_survives_an_unexpected_error_and_keeps_the_last_set() -> None:
    resolver = ScriptedResolver(
        frozenset({"10.0.0.1"}),
        ValueError("a resolver bug"),
        frozenset({"not-an-address"}),  # a resolver that answers nonsense
        frozenset({"10.0.0.2"}),
    )
    errors: list[tuple[Role, str]] = []
    source = DnsSource(
        Role.DECODE,
        "d.test",
        8000,
        interval=1.0,
        timeout=1.0,
        resolver=resolver,
        on_error=lambda role, reason: errors.append((role, reason)),
        sleep=Sleeps(rounds=4),
    )
    sink = Sink()
    with pytest.raises(Stop):
        await source.run(sink)
    assert sink.urls == [["http://10.0.0.1:8000"], ["http://10.0.0.2:8000"]]
    assert [reason.split(":")[0] for _, reason in errors] == ["ValueError", "ValueError"] and source.errors == 2


async def test_static_source_publishes_once_and_runs_until_cancelled() -> None:
    spec = WorkerSpec("http://10.0.0.1:1", Role.DECODE)
    source = build_source(StaticConfig(Role.DECODE, (spec,)))
    assert isinstance(source, StaticSource)
    sink = Sink()
    task = asyncio.create_task(source.run(sink))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert sink.calls == [(Role.DECODE, ["http://10.0.0.1:1"])] and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def pod(name: str, ip: str, ready: bool = True, rv: str = "1") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "resourceVersion": rv},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def lines(*events: tuple[str, dict[str, Any]]) -> bytes:
    return b"".join(json.dumps({"type": t, "object": o}).encode() + b"\n" for t, o in events)


class FakeApi:
    """Answers LIST and WATCH from scripts, and records every request."""

    def __init__(self, lists: list[httpx.Response], watches: list[httpx.Response]) -> None:
        self.lists, self.watches = lists, watches
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        assert request.url.path == "/api/v1/namespaces/llm/pods"
        script = self.watches if request.url.params.get("watch") == "1" else self.lists
        if not script:
            raise Stop
        return script.pop(0)


def kube_source(api: FakeApi, sleeps: Sleeps, errors: list[str] | None = None) -> KubernetesSource:
    cfg = KubernetesConfig(
        Role.DECODE,
        selector="app=d",
        port=8000,
        namespace="llm",
        api_url="http://kube.test",
        token="sekrit",
        watch_timeout=30,
    )
    source = build_source(
        cfg,
        transport=httpx.MockTransport(api),
        on_error=lambda role, reason: (errors if errors is not None else []).append(reason),
    )
    assert isinstance(source, KubernetesSource)
    source._sleep = sleeps
    return source


async def test_kubernetes_lists_then_watches_and_lists_again_on_410() -> None:
    pod_list = {"metadata": {"resourceVersion": "10"}, "items": [pod("a", "10.1.0.1"), pod("b", "10.1.0.2", False)]}
    api = FakeApi(
        lists=[
            httpx.Response(200, json=pod_list),
            httpx.Response(200, json={"metadata": {"resourceVersion": "30"}, "items": [pod("b", "10.1.0.2")]}),
        ],
        watches=[
            httpx.Response(
                200,
                content=lines(("MODIFIED", pod("b", "10.1.0.2", rv="11")), ("DELETED", pod("a", "10.1.0.1", rv="12"))),
            ),
            httpx.Response(200, content=lines(("BOOKMARK", {"metadata": {"resourceVersion": "20"}}))),
            httpx.Response(410, json={"kind": "Status", "code": 410}),
        ],
    )
    sink, sleeps = Sink(), Sleeps(rounds=99)
    with pytest.raises(Stop):
        await kube_source(api, sleeps).run(sink)
    assert sleeps.delays == [0.2]  # one short pause before the re-list: the watches had been working
    assert sink.urls == [
        ["http://10.1.0.1:8000"],
        ["http://10.1.0.1:8000", "http://10.1.0.2:8000"],
        ["http://10.1.0.2:8000"],
    ]  # the re-list after 410 changed nothing: not published again
    watch_rvs = [r.url.params.get("resourceVersion") for r in api.requests if r.url.params.get("watch")]
    assert watch_rvs == ["10", "12", "20", "30"]
    first_watch = next(r for r in api.requests if r.url.params.get("watch"))
    assert first_watch.url.params["labelSelector"] == "app=d" and first_watch.url.params["timeoutSeconds"] == "30"
    assert all(r.headers["authorization"] == "Bearer sekrit" for r in api.requests)


async def test_kubernetes_failures_keep_the_membership_and_back_off() -> None:
    pod_list = {"metadata": {"resourceVersion": "10"}, "items": [pod("a", "10.1.0.1")]}
    api = FakeApi(
        lists=[
            httpx.Response(200, json=pod_list),
            httpx.Response(403, text="forbidden"),
            httpx.Response(200, json=pod_list),
        ],
        watches=[httpx.Response(500, text="etcd down"), httpx.Response(200, content=b"{broken\n")],
    )
    sink, sleeps = Sink(), Sleeps(rounds=99)
    errors: list[str] = []
    source = kube_source(api, sleeps, errors)
    with pytest.raises(Stop):
        await source.run(sink)
    assert sink.urls == [["http://10.1.0.1:8000"]]  # never emptied by the failures
    assert len(errors) == 3 and source.errors == 3
    assert "500" in errors[0] and "403" in errors[1] and "not JSON" in errors[2]
    assert sleeps.delays == [0.2, 0.4, 0.8]  # doubling while failing: a good LIST alone does not reset it


async def test_kubernetes_survives_an_unexpected_error_from_below() -> None:
    pod_list = {"metadata": {"resourceVersion": "10"}, "items": [pod("a", "10.1.0.1")]}
    calls = 0

    def api(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 2:  # the first WATCH hits a bug below httpx (as aiohttp's ValueError for URL credentials)
            raise ValueError("Cannot combine AUTHORIZATION header with AUTH argument")
        if calls == 3:
            return httpx.Response(200, json=pod_list)
        if calls == 1:
            return httpx.Response(200, json={**pod_list, "items": [pod("a", "10.1.0.1"), pod("b", "10.1.0.2")]})
        raise Stop

    sink, sleeps, errors = Sink(), Sleeps(rounds=99), list[str]()
    source = kube_source(FakeApi([], []), sleeps, errors)
    source.api = KubeApi(
        "http://kube.test", token=lambda: None, verify=False, request_timeout=1.0, transport=httpx.MockTransport(api)
    )
    with pytest.raises(Stop):
        await source.run(sink)
    assert sink.urls == [["http://10.1.0.1:8000", "http://10.1.0.2:8000"], ["http://10.1.0.1:8000"]]
    assert errors == ["ValueError: Cannot combine AUTHORIZATION header with AUTH argument"] and source.errors == 1
    assert sleeps.delays == [0.2]


async def test_a_list_that_works_while_watch_is_forbidden_does_not_spin() -> None:
    pod_list = {"metadata": {"resourceVersion": "10"}, "items": [pod("a", "10.1.0.1")]}
    api = FakeApi(
        lists=[httpx.Response(200, json=pod_list) for _ in range(4)],
        watches=[httpx.Response(403, text="cannot watch pods") for _ in range(4)],
    )
    sleeps = Sleeps(rounds=99)
    with pytest.raises(Stop):
        await kube_source(api, sleeps).run(Sink())
    assert sleeps.delays == [0.2, 0.4, 0.8, 1.6]


def test_in_cluster_settings_come_from_the_environment_and_the_service_account(tmp_path: Path) -> None:
    assert (
        in_cluster_api_url({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
        == "https://10.96.0.1:443"
    )
    assert in_cluster_api_url({"KUBERNETES_SERVICE_HOST": "fd00::1"}) == "https://[fd00::1]:443"
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster_api_url({})
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "namespace").write_text("llm\n")
    cfg = KubernetesConfig(
        Role.DECODE, selector="a=b", port=1, token_path=str(tmp_path / "token"), ca_path=str(tmp_path / "ca.crt")
    )
    with pytest.raises(ConfigError, match=r"ca\.crt"):
        build_source(cfg, env={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    source = build_source(
        KubernetesConfig(Role.DECODE, selector="a=b", port=1, token_path=str(tmp_path / "token"), insecure=True),
        env={"KUBERNETES_SERVICE_HOST": "10.96.0.1"},
    )
    assert isinstance(source, KubernetesSource) and source.namespace == "llm"


def test_a_dns_config_builds_a_dns_source_with_the_given_nameserver() -> None:
    source = build_source(DnsConfig(Role.PREFILL, "p.test", 8100, nameserver="127.0.0.1", nameserver_port=5353))
    assert isinstance(source, DnsSource) and (source.name, source.port) == ("p.test", 8100)


async def test_the_routers_pool_is_a_membership_sink() -> None:
    pool = Pool(
        [WorkerSpec("http://10.9.9.9:8000", Role.DECODE), WorkerSpec("http://10.0.0.5:8100", Role.PREFILL)], Metrics()
    )
    resolver = ScriptedResolver(frozenset({"10.0.0.1", "10.0.0.2"}))
    source = DnsSource(Role.DECODE, "d.test", 8000, interval=1.0, timeout=1.0, resolver=resolver, sleep=Sleeps(1))
    with pytest.raises(Stop):
        await source.run(pool)
    assert [s.url for s in pool.members(Role.DECODE)] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert [s.url for s in pool.members(Role.PREFILL)] == ["http://10.0.0.5:8100"]  # the other role is untouched


async def test_watches_that_end_at_once_with_nothing_are_not_reopened_in_a_spin() -> None:
    pod_list = {"metadata": {"resourceVersion": "10"}, "items": []}
    api = FakeApi(lists=[httpx.Response(200, json=pod_list)], watches=[httpx.Response(200) for _ in range(3)])
    sleeps = Sleeps(rounds=99)
    with pytest.raises(Stop):
        await kube_source(api, sleeps).run(Sink())
    assert sleeps.delays == [0.2, 0.4, 0.8]
