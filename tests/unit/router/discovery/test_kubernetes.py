"""The Kubernetes source driven without sockets through httpx.MockTransport: LIST then WATCH, 410, failures,
backoff, and the in-cluster defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.discovery.build import build_source
from router.discovery.kubernetes import KubeApi, KubernetesSource
from router.discovery.settings import KubernetesConfig, in_cluster_api_url
from router.domain import Role
from router.errors import ConfigError
from tests.unit.router.discovery.support import Sink, Sleeps, Stop


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


async def test_watches_that_end_at_once_with_nothing_are_not_reopened_in_a_spin() -> None:
    pod_list = {"metadata": {"resourceVersion": "10"}, "items": []}
    api = FakeApi(lists=[httpx.Response(200, json=pod_list)], watches=[httpx.Response(200) for _ in range(3)])
    sleeps = Sleeps(rounds=99)
    with pytest.raises(Stop):
        await kube_source(api, sleeps).run(Sink())
    assert sleeps.delays == [0.2, 0.4, 0.8]


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
