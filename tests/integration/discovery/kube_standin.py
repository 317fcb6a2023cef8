"""A stand-in Kubernetes API server on loopback: pod LIST and WATCH as the real one serves them.

LIST answers a PodList with metadata.resourceVersion; WATCH streams newline-delimited events (chunked) from a
resourceVersion on, ends after timeoutSeconds with a BOOKMARK, and answers an ERROR event with a 410 Status when
the resourceVersion is older than the compacted history. The test changes pods while sources watch."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import uvicorn

TOKEN = "test-token"
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_PODS_PATH = re.compile(r"/api/v1/namespaces/([^/]+)/pods")


def make_pod(
    name: str,
    ip: str | None,
    *,
    ready: bool,
    labels: dict[str, str],
    annotations: dict[str, str] | None = None,
    namespace: str = "llm",
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": "Running" if ip else "Pending",
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "labels": labels,
            "annotations": annotations or {},
        },
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": status,
    }


@dataclass(frozen=True)
class Event:
    rv: int
    type: str
    pod: dict[str, Any]


def _selected(pod: dict[str, Any], namespace: str, selector: str) -> bool:
    meta = pod["metadata"]
    wanted = [term.split("=", 1) for term in selector.split(",") if term]
    return meta["namespace"] == namespace and all(meta["labels"].get(k) == v for k, v in wanted)


class KubeStandin:
    """The API's pod state and history; an ASGI app served by uvicorn on 127.0.0.1."""

    def __init__(self) -> None:
        self.token = TOKEN  # the bearer token it accepts; a test may rotate it
        self.pods: dict[str, dict[str, Any]] = {}
        self.rv = 100
        self.history: list[Event] = []
        self.compacted = 0  # watches from a resourceVersion below this get 410
        self.generation = 0  # bumped to end every open watch
        self.requests: list[tuple[str, dict[str, str]]] = []  # ("list" | "watch", query)
        self._changed = asyncio.Condition()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.url = ""

    # --- the test's side --------------------------------------------------------------------------------
    def _record(self, kind: str, pod: dict[str, Any]) -> None:
        self.rv += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "DELETED":
            self.pods.pop(pod["metadata"]["name"], None)
        else:
            self.pods[pod["metadata"]["name"]] = pod
        self.history.append(Event(self.rv, kind, pod))

    async def apply(self, pod: dict[str, Any]) -> None:
        self._record("MODIFIED" if pod["metadata"]["name"] in self.pods else "ADDED", pod)
        await self._notify()

    async def delete(self, name: str) -> None:
        pod = copy.deepcopy(self.pods[name])
        pod["metadata"]["deletionTimestamp"] = "2026-11-29T16:00:00Z"
        self._record("MODIFIED", pod)  # graceful deletion first marks the pod, then removes it
        self._record("DELETED", pod)
        await self._notify()

    async def expire_watches(self) -> None:
        """Ends every open watch and compacts history: resuming from any earlier resourceVersion gives 410."""
        self.generation += 1
        self.compacted = self.rv + 1
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # --- serving ------------------------------------------------------------------------------------------
    async def start(self, *, certfile: str | None = None, keyfile: str | None = None) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"{'https' if certfile else 'http'}://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(
            self,
            lifespan="off",
            log_level="warning",
            timeout_graceful_shutdown=2,
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        for _ in range(1000):
            if self._server.started:
                return
            await asyncio.sleep(0.01)
        raise RuntimeError("the stand-in API server did not start")

    async def stop(self) -> None:
        assert self._server is not None and self._task is not None
        self.generation += 1
        await self._notify()
        self._server.should_exit = True
        await asyncio.wait_for(self._task, timeout=10)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        match = _PODS_PATH.fullmatch(scope["path"])
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        if headers.get(b"authorization") != f"Bearer {self.token}".encode():
            await self._json(send, 401, {"kind": "Status", "code": 401, "reason": "Unauthorized"})
        elif match is None or scope["method"] != "GET":
            await self._json(send, 404, {"kind": "Status", "code": 404, "reason": "NotFound"})
        elif query.get("watch") in ("1", "true"):
            self.requests.append(("watch", query))
            await self._watch(send, match.group(1), query)
        else:
            self.requests.append(("list", query))
            items = [
                copy.deepcopy(p)
                for p in self.pods.values()
                if _selected(p, match.group(1), query.get("labelSelector", ""))
            ]
            await self._json(
                send,
                200,
                {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)}, "items": items},
            )

    async def _json(self, send: Send, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": data})

    async def _watch(self, send: Send, namespace: str, query: dict[str, str]) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
        )  # no length: uvicorn chunks it
        line = self._line
        sent, selector = int(query.get("resourceVersion") or self.rv), query.get("labelSelector", "")
        if sent < self.compacted:
            status = {
                "kind": "Status",
                "status": "Failure",
                "reason": "Expired",
                "code": 410,
                "message": f"too old resource version: {sent} ({self.compacted})",
            }
            await send(line("ERROR", status, more=False))
            return
        generation, loop = self.generation, asyncio.get_running_loop()
        deadline = loop.time() + float(query.get("timeoutSeconds", "30"))
        while generation == self.generation and loop.time() < deadline:
            for event in [e for e in self.history if e.rv > sent]:
                if _selected(event.pod, namespace, selector):
                    await send(line(event.type, event.pod))
                sent = event.rv
            async with self._changed:
                if generation != self.generation or (self.history and self.history[-1].rv > sent):
                    continue  # changed while this watch was sending
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - loop.time()))
        if generation == self.generation:  # timed out: a bookmark says how far this watch got
            await send(line("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": str(sent)}}))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    def _line(kind: str, obj: dict[str, Any], more: bool = True) -> MutableMapping[str, Any]:
        return {
            "type": "http.response.body",
            "body": json.dumps({"type": kind, "object": obj}).encode() + b"\n",
            "more_body": more,
        }
