"""The multiturn suite's KV-event fronts (issue 24): which fronts a plan with router replicas runs, and what is
read from their routers besides the turns.

With `replicas >= 2` the engines publish their KV events (HTTP port + stack.engines.KV_EVENT_OFFSETS) and the
suite runs, side by side on the same sessions:

- `kvpush-decider-events`: one router, the session-affinity decider judging decode by the engines' events;
- `kvpush-decider-replicas`: `replicas` routers configured alike, each turn of a conversation sent to the next
  replica (loadtest/multiturn.py `turn_target`), so no replica saw the turn before;
- `kvpush-decider` (unless `events_off_row=false`): one router on its own request-learned index, events off;
- with `estimate_row` (issue 40): `kvpush-decider-estimate`, one router with events on but no tokenizer (the
  estimate path), for the router CPU per turn with the tokenizer option on (`kvpush-decider-events`) and off;
- with `peer_kv_aware` (issue 40's peer row): vllm-router 0.1.17's own KV-event routing (`--policy kv_aware`,
  the prefill's events, session affinity TTL on decode: 0.1.17 takes no decode events in P/D mode) behind one
  router (`vllm-router-kv`) and behind `replicas` routers taking the turns in turn (`vllm-router-kv-replicas`):
  both legs always (`vrouter_kv_argv`).

Per replica: the turns it served and how many it bypassed, first turns apart (`replica_routes`: issue 40's
bypass rate per replica against one router's on the same plan), and how many took the route one router took for
the same turn (`same_route`). Per front, summed over its replicas:
bypass-prediction accuracy and routes (as every kvpush front), the routers'
CPU seconds (their process groups, /proc), and what their subscribers consumed (kvpush_kv_events_frames and
_sequence: messages, events, lag of each live batch from the engine's stamp, batches later than 1 s, gaps,
holes). After an events front's run, a decode's prefix cache is reset and the time until every replica's view
holds nothing for it is taken (`reset_reflected_s`). At the end of the run one decode engine is stopped (what an
engine restart does first) and the time from its exit until every replica's view of it holds nothing is taken
(`engine_stop_reflected`, on the last replicas row).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from loadtest import promtext
from loadtest.bench.point import scrape
from loadtest.bench.procs import group_cpu_seconds
from stack.engines import KV_EVENT_OFFSETS, Engine

EVENTS = "kvpush-decider-events"
REPLICAS = "kvpush-decider-replicas"
EVENTS_OFF = "kvpush-decider"
PEER, PEER_REPLICAS = "vllm-router-kv", "vllm-router-kv-replicas"
ESTIMATE = "kvpush-decider-estimate"
# the frames and sequence counters a run reads (kvpush_kv_events_frames{kind}, kvpush_kv_events_sequence{kind})
FRAME_KINDS = ("messages", "batches", "events", "timed", "lag_us_total", "late", "malformed", "oversized")
SEQUENCE_KINDS = ("gaps", "holes", "replays", "restarts")


def fronts(replicas: int, events_off_row: bool, peer: bool = False, estimate: bool = False) -> tuple[str, ...]:
    """The fronts of a replicas run, the answers' reference first."""
    if replicas < 2:
        raise ValueError("the KV-event fronts need replicas >= 2")
    more = ((EVENTS_OFF,) if events_off_row else ()) + ((ESTIMATE,) if estimate else ())
    return (EVENTS, REPLICAS, *more, *((PEER, PEER_REPLICAS) if peer else ()))


def uses_events(front: str) -> bool:
    return front in (EVENTS, REPLICAS, ESTIMATE)


def replicas_of(front: str, replicas: int) -> int:
    return replicas if front in (REPLICAS, PEER_REPLICAS) else 1


def vrouter_kv_argv(
    binary: str, prefill: str, decodes: Sequence[str], port: int, prom: int, block: int, ttl_s: int = 300
) -> list[str]:
    """vllm-router 0.1.17 in P/D mode with `kv_aware`: prefill picked on the prefill's KV events (the engines
    publish at their HTTP port + KV_EVENT_OFFSETS[0]), decode by its session affinity (soft, by pending and active
    decode requests). 0.1.17 refuses `--kv-event-source` for decodes outside its regular mode ("static
    --kv-event-source is only supported in regular mode", run 20261207T134308Z-smoke): in P/D it follows no
    decode's events, so this is as close to "picks the decode that holds the prefix" as it goes."""
    offset = KV_EVENT_OFFSETS[0]

    def at(url: str, plus: int) -> str:
        host, _, engine_port = url.removeprefix("http://").rpartition(":")
        return f"tcp://{host}:{int(engine_port) + plus}"

    argv = [binary, "--vllm-pd-disaggregation", "--prefill", prefill]
    for d in decodes:
        argv += ["--decode", d]
    argv += ["--kv-connector", "nixl", "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware"]
    argv += ["--pd-kv-events", f"{prefill}={at(prefill, offset)}"]  # P/D mode takes events for prefill only
    argv += ["--kv-event-block-size", str(block), "--kv-event-model", "tiny"]
    argv += ["--kv-aware-session-affinity-ttl-secs", str(ttl_s)]
    argv += ["--worker-startup-check-interval", "1", "--prometheus-port", str(prom), "--log-level", "warning"]
    return argv


def kv_events_yaml() -> str:
    """The routers' kv_events block: the engines' offsets."""
    offset, replay = KV_EVENT_OFFSETS
    return f"kv_events:\n  port_offset: {offset}\n  replay_offset: {replay}\n"


def event_counters(samples: Mapping[promtext.Sample, float]) -> dict[str, float]:
    """The subscriber's counters this suite reads, by `frames.<kind>` / `sequence.<kind>`, and the max lag."""
    out: dict[str, float] = {}
    for group, kinds in (("frames", FRAME_KINDS), ("sequence", SEQUENCE_KINDS)):
        name = f"kvpush_kv_events_{group}_total"
        for kind in kinds:
            out[f"{group}.{kind}"] = promtext.total(samples, name, kind=kind)
    out["frames.lag_us_max"] = promtext.total(samples, "kvpush_kv_events_frames_total", kind="lag_us_max")
    return out


@dataclass
class Readings:
    """What the suite reads from a front's routers before and after its run."""

    cpu_s: float
    events: dict[str, float]  # summed over the replicas (lag_us_max: the largest)


def read(bases: Sequence[str], pids: Sequence[int]) -> Readings:
    events: dict[str, float] = {}
    for base in bases:
        for key, value in event_counters(scrape(base)).items():
            events[key] = max(events.get(key, 0.0), value) if key.endswith("_max") else events.get(key, 0.0) + value
    return Readings(sum(group_cpu_seconds(pid) for pid in pids), events)


def figures(before: Readings, after: Readings, duration_s: float, turns: int, replicas: int) -> dict[str, Any]:
    """The row's router CPU and KV-event figures for one front's run."""
    cpu = after.cpu_s - before.cpu_s
    grew = {k: after.events.get(k, 0.0) - before.events.get(k, 0.0) for k in after.events}
    out: dict[str, Any] = {
        "router_cpu_s": round(cpu, 3),
        "router_cpu_ms_per_turn": round(cpu / turns * 1000, 3) if turns else None,
    }
    if not grew.get("frames.messages"):
        return out
    timed = grew.get("frames.timed", 0.0)
    per = max(1, replicas)
    out["kv_events"] = {
        **{k: int(v) for k, v in grew.items() if not k.endswith("_max")},
        "lag_ms_mean": round(grew["frames.lag_us_total"] / timed / 1000, 3) if timed else None,
        "lag_ms_max_so_far": round(after.events.get("frames.lag_us_max", 0.0) / 1000, 3),
        "events_per_s_per_replica": round(grew.get("frames.events", 0.0) / per / duration_s, 1),
        "messages_per_s_per_replica": round(grew.get("frames.messages", 0.0) / per / duration_s, 1),
    }
    return out


def replica_routes(base: str, prefix: str) -> dict[str, int]:
    """One replica's turns of the run (request ids starting with `prefix`) from its /debug/timings."""
    try:
        records = httpx.get(f"{base}/debug/timings", timeout=30).raise_for_status().json()["requests"]
    except (httpx.HTTPError, KeyError, ValueError) as error:
        print(f"multiturn: no routes from {base}: {error}")
        return {}
    return count_routes(records, prefix)


def modes(base: str, prefix: str) -> dict[str, str]:
    """One router's route (mode) per request id starting with `prefix`, from its /debug/timings."""
    try:
        records = httpx.get(f"{base}/debug/timings", timeout=30).raise_for_status().json()["requests"]
    except (httpx.HTTPError, KeyError, ValueError) as error:
        print(f"multiturn: no modes from {base}: {error}")
        return {}
    return {
        str(r["request_id"]): str(r.get("mode")) for r in records if str(r.get("request_id", "")).startswith(prefix)
    }


def same_route(reference: Sequence[Mapping[str, str]], replicas: Sequence[Mapping[str, str]]) -> list[dict[str, int]]:
    """Per replica: its turns and how many of them took the route the reference front's routers (one router on
    the same sessions) took for the same request id: the replicas decide as one router would, turn by turn,
    whatever share of the pushed turns their place in the rotation gives them. `one_bypass`: how many of the
    replica's turns the reference bypassed (one router's rate on the same turns, the fair base for a replica)."""
    ref = {rid: mode for one in reference for rid, mode in one.items()}
    return [
        {
            "turns": len(m),
            "same": sum(1 for rid, mode in m.items() if ref.get(rid) == mode),
            "one_bypass": sum(1 for rid in m if ref.get(rid) == "bypass"),
        }
        for m in replicas
    ]


def count_routes(records: Sequence[Mapping[str, Any]], prefix: str) -> dict[str, int]:
    """{"turns", "bypass", "first_turns", "first_bypass"} over the records whose request id starts with
    `prefix`; a first turn's id ends in `-t1` (loadtest/multiturn.py names turns `<session>-t<n>`)."""
    out = dict.fromkeys(("turns", "bypass", "first_turns", "first_bypass"), 0)
    for record in records:
        rid = str(record.get("request_id", ""))
        if not rid.startswith(prefix):
            continue
        bypass = record.get("mode") == "bypass"
        first = rid.endswith("-t1")
        out["turns"] += 1
        out["bypass"] += bypass
        out["first_turns"] += first
        out["first_bypass"] += bypass and first
    return out


def _empty_everywhere(bases: Sequence[str], worker: str) -> bool:
    for base in bases:
        samples = scrape(base)
        up = promtext.total(samples, "kvpush_kv_events_caught_up", worker=worker)
        if up != 1 or promtext.total(samples, "kvpush_kv_events_held_blocks", worker=worker) != 0:
            return False
    return True


def reset_reflected(decode_url: str, bases: Sequence[str], limit_s: float = 10.0) -> dict[str, float | None]:
    """Reset the decode's prefix cache and step it once (vLLM publishes what a step collected: an idle engine's
    AllBlocksCleared goes out with its next step); seconds from the reset asked until every replica's view of
    that decode is caught up and empty (`total_s`, polled every 5 ms, None past `limit_s`), of which the reset
    and the one-token request that steps the engine took `reset_and_step_s` (the views may empty before that
    request's answer is back: the event leaves with the step, the answer after it)."""
    poke = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    t0 = time.monotonic()
    httpx.post(f"{decode_url}/reset_prefix_cache", timeout=30).raise_for_status()
    httpx.post(f"{decode_url}/v1/completions", json=poke, timeout=60).raise_for_status()
    found: dict[str, float | None] = {"reset_and_step_s": round(time.monotonic() - t0, 4), "total_s": None}
    while time.monotonic() - t0 < limit_s:
        if _empty_everywhere(bases, decode_url):
            found["total_s"] = round(time.monotonic() - t0, 4)
            break
        time.sleep(0.005)
    return found


def settle_views(engines: Sequence[str], bases: Sequence[str], limit_s: float = 10.0) -> float | None:
    """After the engines' prefix caches were reset: step each engine once (an idle engine publishes its
    AllBlocksCleared with its next step; a one-token prompt stores no block) and wait until every replica's view
    of every engine is caught up and empty; seconds taken, None past `limit_s` (polled every 5 ms). Without it
    a front's routers still see the blocks the previous front's turns stored: the same sessions, the same ids."""
    poke = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    t0 = time.monotonic()
    for engine in engines:
        httpx.post(f"{engine}/v1/completions", json=poke, timeout=60).raise_for_status()
    while time.monotonic() - t0 < limit_s:
        if all(_empty_everywhere(bases, engine) for engine in engines):
            return round(time.monotonic() - t0, 4)
        time.sleep(0.005)
    return None


def stop_reflected(engine: Engine, bases: Sequence[str], limit_s: float = 10.0) -> dict[str, Any]:
    """Stop the engine (SIGTERM, reaped); the blocks every replica's view held for it before, and seconds from
    the stop asked and from its exit until every view of it holds nothing (None past `limit_s`)."""
    held = [promtext.total(scrape(base), "kvpush_kv_events_held_blocks", worker=engine.url) for base in bases]
    t0 = time.monotonic()
    engine.stop()
    exited = time.monotonic()
    found: dict[str, Any] = {"held_blocks_before": held, "stop_s": round(exited - t0, 3), "after_exit_s": None}
    while time.monotonic() - exited < limit_s:
        if all(_held(base, engine.url) == 0 for base in bases):
            found["after_exit_s"] = round(time.monotonic() - exited, 4)
            break
        time.sleep(0.005)
    return found


def _held(base: str, worker: str) -> float:
    return promtext.total(scrape(base), "kvpush_kv_events_held_blocks", worker=worker)
