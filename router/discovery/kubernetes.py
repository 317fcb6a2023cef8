"""Kubernetes discovery: ready pods by label selector, LIST then WATCH through the API, re-listed when stale."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from router.discovery.base import Backoff, ErrorHook, MembershipSink, Publisher
from router.discovery.pods import (
    Members,
    WatchEvent,
    WatchFailed,
    WatchGone,
    apply_event,
    members_from_list,
    parse_event,
)
from router.discovery.settings import KubernetesConfig, in_cluster
from router.domain import Role, Sleep

logger = logging.getLogger("kvpush.discovery")

TokenSource = Callable[[], str | None]


class ApiError(Exception):
    """The API server answered a call with an unexpected status."""


class KubeApi:
    """The two calls discovery makes (list pods, watch pods), each under a deadline. Owns its HTTP client."""

    def __init__(
        self,
        base_url: str,
        *,
        token: TokenSource,
        verify: ssl.SSLContext | bool,
        request_timeout: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.request_timeout = request_timeout
        self._token = token
        self._client = httpx.AsyncClient(
            base_url=base_url, verify=verify, transport=transport, timeout=httpx.Timeout(request_timeout)
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def _headers(self) -> dict[str, str]:
        token = self._token()
        return {"Accept": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}

    async def list_pods(self, namespace: str, selector: str) -> Mapping[str, Any]:
        async with asyncio.timeout(self.request_timeout):
            response = await self._client.get(
                f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": selector}, headers=self._headers()
            )
        if response.status_code != 200:
            raise ApiError(f"LIST pods answered {response.status_code}: {response.text[:300]}")
        try:
            data = response.json()
        except ValueError:
            raise WatchFailed(f"LIST pods answered non-JSON: {response.text[:200]!r}") from None
        if not isinstance(data, Mapping):
            raise WatchFailed(f"LIST pods answered {str(data)[:200]}")
        return data

    async def watch_pods(
        self,
        namespace: str,
        selector: str,
        resource_version: str,
        timeout_seconds: int,
        on_event: Callable[[WatchEvent], None],
    ) -> None:
        """Streams events into `on_event` until the server ends the watch (after about `timeout_seconds`)."""
        params = {
            "labelSelector": selector,
            "watch": "1",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_seconds),
            "allowWatchBookmarks": "true",
        }
        deadline = httpx.Timeout(self.request_timeout, read=timeout_seconds + 5.0)
        async with (
            asyncio.timeout(timeout_seconds + self.request_timeout + 5.0),
            self._client.stream(
                "GET", f"/api/v1/namespaces/{namespace}/pods", params=params, headers=self._headers(), timeout=deadline
            ) as response,
        ):
            if response.status_code == 410:
                raise WatchGone(f"WATCH from resourceVersion {resource_version} answered 410 Gone")
            if response.status_code != 200:
                body = (await response.aread())[:300]
                raise ApiError(f"WATCH pods answered {response.status_code}: {body!r}")
            async for line in response.aiter_lines():
                if line.strip():
                    on_event(parse_event(line))


class KubernetesSource:
    """One role's workers are the ready pods matching a selector. Failures keep the last membership."""

    def __init__(
        self,
        role: Role,
        api: KubeApi,
        *,
        namespace: str,
        selector: str,
        port: int,
        watch_timeout: int,
        backoff_max: float,
        on_error: ErrorHook | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.role = role
        self.api = api
        self.namespace = namespace
        self.selector = selector
        self.port = port
        self.watch_timeout = watch_timeout
        self.members = Members()
        self.errors = 0
        self._backoff = Backoff(0.2, backoff_max)
        self._on_error = on_error
        self._sleep = sleep

    async def run(self, sink: MembershipSink) -> None:
        """LIST, then WATCH from the list's resourceVersion again and again; on 410 or a failure, LIST again."""
        publisher = Publisher(self.role, sink)
        try:
            while True:
                try:
                    await self._list_and_watch(publisher)
                except WatchGone as exc:
                    logger.info("%s discovery: %s; listing again", self.role, exc)
                except (httpx.HTTPError, ApiError, WatchFailed, TimeoutError) as exc:
                    self._failed(publisher, f"{type(exc).__name__}: {exc}")
                except Exception as exc:  # unexpected: this round fails (logged, counted), not the loop
                    logger.exception("%s discovery: an unexpected error", self.role)
                    self._failed(publisher, f"{type(exc).__name__}: {exc}")
                await self._sleep(self._backoff.next())
        finally:
            await self.api.aclose()

    async def _list_and_watch(self, publisher: Publisher) -> None:
        pods = await self.api.list_pods(self.namespace, self.selector)
        self.members, resource_version = members_from_list(pods, self.role, self.port)
        self._changed(publisher, "list")

        events = 0

        def on_event(event: WatchEvent) -> None:
            nonlocal resource_version, events
            self.members, rv = apply_event(self.members, event, self.role, self.port)
            resource_version = rv or resource_version
            events += 1
            self._changed(publisher, event.type)
            self._backoff.reset()  # only a working watch resets it: a LIST that works while WATCH fails must wait

        loop = asyncio.get_running_loop()
        while True:
            events, started = 0, loop.time()
            await self.api.watch_pods(self.namespace, self.selector, resource_version, self.watch_timeout, on_event)
            if events == 0 and loop.time() - started < self.watch_timeout / 2:
                await self._sleep(self._backoff.next())  # ended early with nothing: do not spin on such a server

    def _changed(self, publisher: Publisher, why: str) -> None:
        for problem in self.members.problems:
            logger.warning("%s discovery: %s (left out)", self.role, problem)
        specs = self.members.specs()
        changed = publisher.publish(specs)
        if changed:
            logger.info(
                "%s discovery (%s %s, %s): %d pod(s) ready: %s",
                self.role,
                self.namespace,
                self.selector,
                why,
                len(specs),
                " ".join(s.url for s in specs) or "none",
            )

    def _failed(self, publisher: Publisher, reason: str) -> None:
        logger.warning("%s discovery: %s; keeping %d known worker(s)", self.role, reason, len(publisher.last or ()))
        self.errors += 1
        if self._on_error is not None:
            self._on_error(self.role, reason)


def _token_source(cfg: KubernetesConfig) -> TokenSource:
    if cfg.token is not None:
        literal = cfg.token
        return lambda: literal
    path = Path(cfg.token_path)

    def read() -> str | None:  # read before every call: projected service-account tokens rotate
        try:
            return path.read_text().strip() or None
        except OSError as exc:  # absent (e.g. kubectl proxy) or unreadable: the call goes without, and says why
            logger.debug("no service-account token: %s", exc)
            return None

    return read


def _verify(cfg: KubernetesConfig, api_url: str) -> ssl.SSLContext | bool:
    if cfg.insecure:
        return False
    if not api_url.startswith("https://") or cfg.ca_path is None:
        return True
    return ssl.create_default_context(cafile=cfg.ca_path)  # in_cluster checked that the file exists


def kubernetes_source(
    cfg: KubernetesConfig,
    *,
    env: Mapping[str, str],
    transport: httpx.AsyncBaseTransport | None,
    on_error: ErrorHook | None = None,
    sleep: Sleep = asyncio.sleep,
) -> KubernetesSource:
    """The source for `cfg`, with the in-cluster defaults filled in from `env` where the settings did not already
    (raises ConfigError when one is missing)."""
    cfg = in_cluster(cfg, env)
    assert cfg.api_url is not None and cfg.namespace is not None  # in_cluster resolves both
    api = KubeApi(
        cfg.api_url,
        token=_token_source(cfg),
        verify=_verify(cfg, cfg.api_url),
        request_timeout=cfg.request_timeout,
        transport=transport,
    )
    return KubernetesSource(
        cfg.role,
        api,
        namespace=cfg.namespace,
        selector=cfg.selector,
        port=cfg.port,
        watch_timeout=cfg.watch_timeout,
        backoff_max=cfg.backoff_max,
        on_error=on_error,
        sleep=sleep,
    )
