"""KV-event faults (issue 42 item 2) on bed `vllm-events`: every engine publishes its KV events (vLLM's ZMQ PUB on
its HTTP port + 1000, replay on + 2000), and two router replicas with the session-affinity decider follow them
through a relay per engine (this module's `Relay`: SUB from the engine, PUB on the HTTP port + RELAY_OFFSET; the
routers' `kv_events.port_offset`), replay straight from the engine. Sessions alternate replicas under load, and
the decode's relay first drops a run of live events (a gap: each replica must notice and replay it) and then
restarts its publisher socket (each replica's subscription drops: it must start the stream over). Every bypass
either replica decides meanwhile must be correct: decode computed no more of the prompt than the router predicted
(its "bypass checked" log lines)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import zmq

from loadtest import promtext
from loadtest.faults.bed import MODEL_DIR, Bed, BedShape, RouterProc, start_router
from loadtest.faults.rows import FaultRow
from loadtest.faults.scenarios import FaultOutcome
from stack.engines import KV_EVENT_OFFSETS

RELAY_OFFSET = 3000  # the relays publish on each engine's HTTP port + this; the routers subscribe there
BLOCK_TOKENS = 128  # vLLM's CPU backend's default block size (the bed's engines)
# the decider as `kvpush stack` runs it with KV events: the model's tokenizer, so it decides on exact token ids (the
# estimate path without it mispredicts a first turn's size, which this row would count as stale)
ROUTER_CONFIG = {
    "decider": {
        "name": "session-affinity",
        "bypass_max_uncached_tokens": 256,
        "block_tokens": BLOCK_TOKENS,
        "tokenizer": str(MODEL_DIR),
    },
    "kv_events": {"port_offset": RELAY_OFFSET, "replay_offset": KV_EVENT_OFFSETS[1]},
}
DROP = 20  # live event messages the decode's relay drops
SESSIONS = 4  # concurrent sessions, each alternating the two replicas turn by turn
LOAD_S = 45.0  # of which DROP_AT s before the drop and RESTART_AT before the publisher restart
DROP_AT, RESTART_AT = 10.0, 25.0
SEQUENCE = "kvpush_kv_events_sequence_total"
EVENTS_SHAPE = BedShape("faults-events", kv_events=True, router_config=ROUTER_CONFIG)


class Relay:
    """One engine's KV-event publisher seen through a relay: forwards every multipart message unless told to drop
    the next `n` (`drop`), and can close and rebind its PUB socket (`restart`), as a restarted publisher would.
    All socket work on its own thread."""

    def __init__(self, upstream: str, bind: str) -> None:
        self.upstream, self.bind = upstream, bind
        self.forwarded = self.dropped = self.restarts = 0
        self._drop = 0
        self._restart = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def drop(self, n: int) -> None:
        self._drop = n

    def restart(self) -> None:
        self._restart.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.upstream)
        pub = ctx.socket(zmq.PUB)
        pub.bind(self.bind)
        try:
            while not self._stop.is_set():
                if self._restart.is_set():
                    pub.close(linger=0)
                    time.sleep(0.5)
                    pub = ctx.socket(zmq.PUB)
                    pub.bind(self.bind)
                    self.restarts += 1
                    self._restart.clear()
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if self._drop > 0:
                    self._drop -= 1
                    self.dropped += 1
                    continue
                pub.send_multipart(frames)
                self.forwarded += 1
        finally:
            pub.close(linger=0)
            sub.close(linger=0)
            ctx.term()


def relay_for(url: str) -> Relay:
    """The relay of the engine at `url`: from its publisher (HTTP port + 1000) to the routers' (+ RELAY_OFFSET)."""
    port = int(url.rsplit(":", 1)[1])
    return Relay(f"tcp://127.0.0.1:{port + KV_EVENT_OFFSETS[0]}", f"tcp://127.0.0.1:{port + RELAY_OFFSET}")


@dataclass(frozen=True)
class Bypasses:
    checked: int
    stale: int  # decode computed more of the prompt than the router predicted: it credited blocks decode lacked


def judge_bypasses(lines: Iterable[str], since: str) -> Bypasses:
    """Pure: the "bypass checked" lines of a router's JSON log at or after `since` (an ISO timestamp)."""
    checked = stale = 0
    for line in lines:
        if "bypass checked" not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("ts", "") < since:
            continue
        fields = record.get("fields", record)
        computed, predicted = fields.get("computed_tokens"), fields.get("predicted_uncached_tokens")
        if not isinstance(computed, int) or not isinstance(predicted, int):
            continue
        checked += 1
        stale += computed > predicted
    return Bypasses(checked, stale)


def _sequence(router: RouterProc, http: httpx.Client) -> dict[str, float]:
    samples = promtext.parse(http.get(f"{router.url}/metrics", timeout=5.0).text)
    return promtext.by_label(samples, SEQUENCE, "kind")


def _session(urls: list[str], until: float) -> list[int]:
    """Turns alternating replicas (one X-Session-ID) until `until`; a fresh session every three turns. The first
    turn is long (pushed), the later ones short, so their uncached tail fits the bypass rule: the replicas bypass
    them on what their views say decode holds, which is what the row judges."""
    statuses: list[int] = []
    while time.monotonic() < until:
        session, history = f"faults-{uuid.uuid4().hex}", []
        for turn in range(3):
            lines = 40 if turn == 0 else 2
            history.append({"role": "user", "content": f"# {uuid.uuid4().hex}\n" + "def f(x): return x\n" * lines})
            body = {"model": "tiny", "messages": history, "max_tokens": 16, "temperature": 0}
            try:
                r = httpx.post(
                    f"{urls[turn % 2]}/v1/chat/completions", json=body, headers={"X-Session-ID": session}, timeout=120
                )
            except httpx.HTTPError:
                statuses.append(0)
                break
            statuses.append(r.status_code)
            if r.status_code != 200:
                break
            history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    return statuses


def events_lost_and_restarted(bed: Bed, row: FaultRow) -> FaultOutcome:
    decode = bed.decodes[0]
    relays = {w.name: relay_for(w.url) for w in bed.workers}
    for relay in relays.values():
        relay.start()
    second = start_router([w.router_arg for w in bed.prefills], [decode.url], bed.router.config, bed.started)
    replicas = [bed.router, second]
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    try:
        with httpx.Client() as http:
            before = [_sequence(r, http) for r in replicas]
            until = time.monotonic() + LOAD_S
            with ThreadPoolExecutor(SESSIONS) as pool:
                loops = [pool.submit(_session, [r.url for r in replicas], until) for _ in range(SESSIONS)]
                time.sleep(DROP_AT)
                relays[decode.name].drop(DROP)
                t_fault = time.monotonic()
                time.sleep(RESTART_AT - DROP_AT)
                relays[decode.name].restart()
                statuses = [s for f in loops for s in f.result()]
            t_end = time.monotonic()
            time.sleep(3.0)  # the last events of the last turns reach the replicas
            after = [_sequence(r, http) for r in replicas]
        bypasses = [judge_bypasses(_lines(r.handle.log_path), since) for r in replicas]
    finally:
        for relay in relays.values():
            relay.stop()
        bed.started.remove(second.handle)
        second.handle.stop(10.0)
    return _judge(statuses, before, after, bypasses, relays[decode.name], t_end - t_fault)


def _lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines()


def _judge(
    statuses: list[int],
    before: list[dict[str, float]],
    after: list[dict[str, float]],
    bypasses: list[Bypasses],
    relay: Relay,
    seconds: float,
) -> FaultOutcome:
    moved = [{k: a.get(k, 0.0) - b.get(k, 0.0) for k in a} for a, b in zip(after, before, strict=True)]
    noticed = all(m.get("gaps", 0) + m.get("lost", 0) + m.get("holes", 0) > 0 for m in moved)
    restarted = all(m.get("restarts", 0) > 0 for m in moved)
    served = sum(1 for s in statuses if s == 200)
    stale = sum(b.stale for b in bypasses)
    ok = served == len(statuses) > 0 and noticed and restarted and stale == 0
    per = "; ".join(
        f"replica {i}: " + ", ".join(f"{k} +{v:g}" for k, v in sorted(m.items()) if v) + f", bypasses {b.checked} "
        f"checked, {b.stale} stale"
        for i, (m, b) in enumerate(zip(moved, bypasses, strict=True))
    )
    note = (
        f"decode's relay dropped {relay.dropped} event messages at {DROP_AT:g} s and restarted its publisher at "
        f"{RESTART_AT:g} s ({relay.forwarded} forwarded); {per}"
    )
    summary = ", ".join(f"{s} x{statuses.count(s)}" for s in sorted(set(statuses))) or "no request ran"
    return FaultOutcome(summary, ok, seconds, note)


EVENTS: dict[str, Callable[[Bed, FaultRow], FaultOutcome]] = {"events-lost-restart": events_lost_and_restarted}
