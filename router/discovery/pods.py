"""Kubernetes pod membership decisions: pod JSON → worker, pod lists and watch events → members. Pure."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.discovery.base import worker_url
from router.domain import NixlIdentity, Role, WorkerSpec
from router.workers.ranks import MAX_DP_SIZE

ANNOTATION_PORT = "kvpush.io/port"
ANNOTATION_ENGINE_ID = "kvpush.io/engine-id"
ANNOTATION_SIDE_PORT = "kvpush.io/side-port"
ANNOTATION_TP = "kvpush.io/tp"
ANNOTATION_PP = "kvpush.io/pp"
ANNOTATION_DP = "kvpush.io/dp-size"  # the pod's vLLM runs --data-parallel-size N (one URL, N ranks)

EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")


class BadPod(ValueError):
    """A pod that would be a member, but whose kvpush.io annotations are unusable."""


class WatchGone(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class WatchFailed(Exception):
    """The API server ended the watch with an error event, or sent something that is not a watch event."""


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def pod_name(pod: Mapping[str, Any]) -> str:
    name = _meta(pod).get("name")
    if not isinstance(name, str) or not name:
        raise WatchFailed(f"a pod without metadata.name: {str(pod)[:200]}")
    return name


def resource_version(obj: Mapping[str, Any]) -> str | None:
    rv = _meta(obj).get("resourceVersion")
    return rv if isinstance(rv, str) and rv else None


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Ready condition True, an IP, and not being deleted."""
    status = pod.get("status")
    if not isinstance(status, Mapping) or not status.get("podIP") or _meta(pod).get("deletionTimestamp"):
        return False
    conditions = status.get("conditions")
    return isinstance(conditions, list) and any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def _number(annotations: Mapping[str, Any], key: str, default: int | None, *, high: int | None = None) -> int | None:
    value = annotations.get(key)
    if value is None:
        return default
    try:
        number = int(str(value).strip())
    except ValueError:
        raise BadPod(f"annotation {key}={value!r} is not an integer") from None
    if number < 1 or (high is not None and number > high):
        raise BadPod(f"annotation {key}={value!r} is out of range")
    return number


def pod_member(pod: Mapping[str, Any], role: Role, default_port: int) -> WorkerSpec | None:
    """The worker this pod is, or None while it is not a ready member. Raises BadPod for bad annotations."""
    if not pod_ready(pod):
        return None
    ip = str(pod["status"]["podIP"])
    raw = _meta(pod).get("annotations")
    annotations: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    port = _number(annotations, ANNOTATION_PORT, None, high=65535) or default_port
    identity = None
    engine_id = annotations.get(ANNOTATION_ENGINE_ID)
    side_port = _number(annotations, ANNOTATION_SIDE_PORT, None, high=65535)
    if role is Role.PREFILL and (engine_id or side_port is not None):
        if not engine_id or side_port is None:
            raise BadPod(
                f"annotations {ANNOTATION_ENGINE_ID} and {ANNOTATION_SIDE_PORT} go together; "
                f"give both or neither (identity learned)"
            )
        identity = NixlIdentity(
            engine_id=str(engine_id),
            host=ip,
            port=side_port,
            tp_size=_number(annotations, ANNOTATION_TP, 1) or 1,
            pp_size=_number(annotations, ANNOTATION_PP, 1) or 1,
        )
    dp_size = _number(annotations, ANNOTATION_DP, 1, high=MAX_DP_SIZE) or 1
    return WorkerSpec(url=worker_url(ip, port), role=role, identity=identity, dp_size=dp_size)


@dataclass(frozen=True)
class Members:
    """Pod name → worker, for the ready pods; `problems` says which pods were left out and why."""

    by_pod: Mapping[str, WorkerSpec] = field(default_factory=dict)
    problems: tuple[str, ...] = ()

    def specs(self) -> list[WorkerSpec]:
        """The membership to publish: one worker per URL, in URL order."""
        unique = {s.url: s for s in sorted(self.by_pod.values(), key=lambda s: s.url)}
        return list(unique.values())


def _with_pod(
    by_pod: Mapping[str, WorkerSpec], pod: Mapping[str, Any], role: Role, default_port: int
) -> tuple[dict[str, WorkerSpec], str | None]:
    out = dict(by_pod)
    name = pod_name(pod)
    try:
        spec = pod_member(pod, role, default_port)
        problem = None
    except BadPod as exc:
        spec, problem = None, f"pod {name}: {exc}"
    if spec is None:
        out.pop(name, None)
    else:
        out[name] = spec
    return out, problem


def members_from_list(pod_list: Mapping[str, Any], role: Role, default_port: int) -> tuple[Members, str]:
    """A PodList → its members and the list's resourceVersion (where the watch starts)."""
    items = pod_list.get("items")
    rv = resource_version(pod_list)
    if not isinstance(items, list) or rv is None or not all(isinstance(pod, Mapping) for pod in items):
        raise WatchFailed(f"not a PodList with items and metadata.resourceVersion: {str(pod_list)[:200]}")
    by_pod: dict[str, WorkerSpec] = {}
    problems: list[str] = []
    for pod in items:
        by_pod, problem = _with_pod(by_pod, pod, role, default_port)
        problems += [problem] if problem else []
    return Members(by_pod, tuple(problems)), rv


@dataclass(frozen=True)
class WatchEvent:
    type: str
    object: Mapping[str, Any]


def parse_event(line: bytes | str) -> WatchEvent:
    """One line of a watch stream."""
    try:
        data = json.loads(line)
    except ValueError:
        raise WatchFailed(f"a watch line that is not JSON: {line[:200]!r}") from None
    if (
        not isinstance(data, Mapping)
        or data.get("type") not in EVENT_TYPES
        or not isinstance(data.get("object"), Mapping)
    ):
        raise WatchFailed(f"not a watch event: {str(data)[:200]}")
    return WatchEvent(type=str(data["type"]), object=data["object"])


def apply_event(members: Members, event: WatchEvent, role: Role, default_port: int) -> tuple[Members, str | None]:
    """The members after `event`, and the resourceVersion to resume from (None: unchanged).
    Raises WatchGone on a 410 error event and WatchFailed on any other error event."""
    if event.type == "ERROR":
        code = event.object.get("code")
        message = f"watch error {code}: {event.object.get('reason')}: {event.object.get('message')}"
        raise WatchGone(message) if code == 410 else WatchFailed(message)
    rv = resource_version(event.object)
    if event.type == "BOOKMARK":
        return members, rv
    if event.type == "DELETED":
        by_pod = {k: v for k, v in members.by_pod.items() if k != pod_name(event.object)}
        return Members(by_pod), rv
    by_pod, problem = _with_pod(members.by_pod, event.object, role, default_port)
    return Members(by_pod, (problem,) if problem else ()), rv
