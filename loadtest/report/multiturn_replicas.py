"""The multiturn suite's replicas run (suite "multiturn-replicas", issue 24) in bench/README.md's multi-turn
section: the fronts' table as for any multi-turn run, then issue 24's targets, judged within each repeat (the
fronts saw the same sessions there) and the median of the repeats' ratios stated.

- decode-local hits (share of an ideal router's reuse) behind two replicas over one replica, both with KV events
  on: >= 0.9;
- bypass predictions within ±20 % for >= 90 % of the bypass decisions, on each events front (runs before issue
  40's exact path: their rows carry no request-by-request checks);
- router CPU per turn with events on over events off (one router each): <= 1.1;
- what the subscribers consumed: events and messages per second per replica, each live batch's lag from the
  engine's stamp (mean, max, later than 1 s), gaps and holes; and a decode's reset reflected in every replica's
  view: <= 1 s;
- issue 40, where the rows carry each replica's routes: each replica's bypass rate (turns it served bypassed)
  against the one-router events front's on the same sessions, >= 0.95x, replicas within 5 points of each other;
  each replica's route turn by turn against one router's; and each bypass's predicted uncached tokens against
  decode's computed tokens, request by request (`bypass_checks`): equal for every one (older rows: the sums);
- the subscriber's capacity against a paced synthetic publisher (bench/results/kv-events-rate.json, written by
  loadtest/micro/kv_events_rate.py), when that file is there.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtest.report import multiturn

EVENTS, REPLICAS, EVENTS_OFF = "kvpush-decider-events", "kvpush-decider-replicas", "kvpush-decider"
PEER, PEER_REPLICAS = "vllm-router-kv", "vllm-router-kv-replicas"
ESTIMATE = "kvpush-decider-estimate"
TOKENIZER_CPU_TARGET = 1.3
LOOPBACK_TTFT_TARGET = 1.0
HIT_TARGET = 0.9
RATE_TARGET, SPREAD_POINTS = 0.95, 5.0
CPU_TARGET = 1.1
REFLECT_TARGET_S = 1.0
Row = Mapping[str, Any]


def section(rows: Sequence[Row], rate: Path | None = None, overhead: Sequence[Row] = ()) -> list[str]:
    """The subsection's lines (after its heading); nothing without rows. `rate`: kv-events-rate.json;
    `overhead`: the latest overhead-events run's rows."""
    if not rows:
        return []
    replicas = max(int(r.get("replicas") or 1) for r in rows)
    head = [
        f"Run {rows[0].get('run_id')}: the decider with the engines' KV events on behind one router"
        f" (`{EVENTS}`) and behind {replicas} router replicas with each turn of a conversation sent to the next"
        f" replica (`{REPLICAS}`){_others(rows)}, on the same sessions and engines (which publish their events"
        " throughout).",
        *_tokenizer(rows),
        "",
    ]
    body = [line for line in multiturn.section(rows, None) if not line.startswith("\nTTFT p50")]
    more = [*capacity(rate), *overhead_cpu(overhead)]
    return [*head, *body, "", *targets(rows), *more, "", reproduce(rows[0].get("plan") or {})]


def _others(rows: Sequence[Row]) -> str:
    """The run's other fronts, as the head names them."""
    fronts = {str(r.get("front")) for r in rows}
    named = {
        EVENTS_OFF: f"with events off on one router (`{EVENTS_OFF}`)",
        ESTIMATE: f"one events router without the tokenizer (`{ESTIMATE}`)",
        PEER: f"vllm-router 0.1.17's `kv_aware` behind one router (`{PEER}`)",
        PEER_REPLICAS: f"and behind as many routers (`{PEER_REPLICAS}`)",
    }
    shown = [text for front, text in named.items() if front in fronts]
    return ", " + ", ".join(shown) if shown else ""


def _tokenizer(rows: Sequence[Row]) -> list[str]:
    """Whether the KV-event fronts' deciders had the model's tokenizer (rows of runs before it have no field)."""
    if not any(r.get("answer_tokenizer") for r in rows):
        return []
    exact = any(r.get("bypass_by_replica") is not None for r in rows)  # runs since issue 40's exact path
    how = (
        " it decides on the prompts' exact token ids and the blocks the engines' KV events report"
        ' (docs/multi-turn.md, "The exact path")'
        if exact
        else " before a bypass, a replica checks the previous answer, which the other replica relayed, against the"
        " token ids the engine stored"
    )
    return [
        f"The KV-event fronts' deciders have the model's tokenizer (option `tokenizer`):{how}. The box (2 cores) is"
        " shared with other work; the vLLM lock keeps other engines off it during the run."
    ]


def overhead_cpu(rows: Sequence[Row]) -> list[str]:
    """The overhead suite's kvpush push router with KV events on over off: CPU per request, paired by repeat at
    each concurrency, the median ratio judged against the target; nothing without such a run."""
    cpu: dict[tuple[int, int], dict[str, float]] = {}
    for r in rows:
        if r.get("router") == "kvpush" and r.get("mode") == "push" and r.get("cpu_s_per_1k") is not None:
            key = (int(r.get("concurrency") or 0), int(r.get("repeat") or 0))
            cpu.setdefault(key, {})[str(r.get("kv_events") or "off")] = float(r["cpu_s_per_1k"])
    per: dict[int, list[float]] = {}
    for (conc, _), pair in sorted(cpu.items()):
        if pair.get("off") and "on" in pair:
            per.setdefault(conc, []).append(pair["on"] / pair["off"])
    if not per:
        return []
    out = [
        "",
        f"Router CPU per request, KV events on / off, overhead suite on zero-cost simulated workers (run"
        f" {rows[0].get('run_id')}; they publish nothing: the events' fixed cost on a request, not their"
        " consumption; target <= 1.1):",
        "",
    ]
    for conc, ratios in per.items():
        ratio = statistics.median(ratios)
        each = ", ".join(f"{x:.2f}" for x in ratios)
        verdict = "met" if ratio <= CPU_TARGET else "not met"
        out.append(f"- concurrency {conc}: {ratio:.2f} (per repeat: {each}; {verdict})")
    return out


def reproduce(plan: Mapping[str, Any]) -> str:
    """The command that runs this plan again (the fields a replicas run usually sets)."""
    usual = (
        "replicas",
        "sessions",
        "session_rate",
        "turns_min",
        "turns_max",
        "repeats",
        "warmup_sessions",
        "connector",
    )
    unset = {"api": "chat", "burst": 1, "system_tokens": 0, "system_shared": False, "events_off_row": True}
    unset |= {"estimate_row": False, "peer_kv_aware": False, "message_max": 500, "max_model_len": 8192}
    keys = [*usual, *(k for k, v in unset.items() if k in plan and plan[k] != v)]  # issue 40's plan: when set
    sets = " ".join(
        f"--set {k}={str(plan[k]).lower() if isinstance(plan[k], bool) else plan[k]}" for k in keys if k in plan
    )
    return f"Reproduce: `flock /tmp/kvpush-vllm.lock kvpush bench --suite multiturn {sets}`."


def capacity(path: Path | None) -> list[str]:
    """The subscriber against a synthetic publisher, one line per rate; nothing without the file."""
    if path is None or not path.exists():
        return []
    data = json.loads(path.read_text(encoding="utf-8"))
    rows = data.get("rows") or []
    if not rows:
        return []
    out = [
        "",
        f"The subscriber alone against a paced vLLM-shaped publisher (run {data.get('run_id')}, load average"
        f" {data.get('loadavg', 0):.1f} on the 2 cores; {rows[0].get('blocks_per_message')} blocks stored and as many"
        " evicted per message; loadtest/micro/kv_events_rate.py):",
        "",
        "| messages/s asked | events/s consumed | blocks/s | gaps | lag mean / max (ms) | later than 1 s"
        " | CPU per 1000 messages (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.get('rate_asked', 0):.0f} | {r.get('events_per_s')} | {r.get('blocks_per_s')} | {r.get('gaps')}"
            f" | {r.get('lag_ms_mean')} / {r.get('lag_ms_max')} | {r.get('late_over_1s')}"
            f" | {r.get('cpu_ms_per_1k_messages')} |"
        )
    return out


def targets(rows: Sequence[Row]) -> list[str]:
    out = [
        _ratio_line(
            "decode-local hits / ideal reuse, replicas / one replica (events on)",
            rows,
            REPLICAS,
            EVENTS,
            "local_hit_frac_of_ideal",
            HIT_TARGET,
            at_least=True,
        )
    ]
    for front in (EVENTS, REPLICAS):
        mine = [r for r in rows if r.get("front") == front]
        if mine and not any(r.get("bypass_checks") for r in mine):  # the exact path's rows: exact_lines
            line = multiturn.accuracy_line(multiturn.summed_accuracy(mine))
            out.append("- " + line.replace(", decider:", f", {front}:").replace("\n", ""))
    out.append(
        _ratio_line(
            "router CPU per turn, events on / off (one router)",
            rows,
            EVENTS,
            EVENTS_OFF,
            "router_cpu_ms_per_turn",
            CPU_TARGET,
            at_least=False,
        )
    )
    out += exact_lines(rows)
    if any(r.get("front") == ESTIMATE for r in rows):
        what = "router CPU per turn, tokenizer option on / off (one router, events on)"
        out.append(_ratio_line(what, rows, EVENTS, ESTIMATE, "router_cpu_ms_per_turn", TOKENIZER_CPU_TARGET, False))
    out += [f"- {_consumed(front, r)}" for front in (EVENTS, REPLICAS) for r in rows if r.get("front") == front]
    out += [_stopped(found) for r in rows if (found := r.get("engine_stop_reflected"))]
    return out


def _rate(counts: Mapping[str, int]) -> float | None:
    turns = counts.get("turns") or 0
    return counts.get("bypass", 0) / turns if turns else None


def exact_lines(rows: Sequence[Row]) -> list[str]:
    """Issue 40's lines, per repeat: bypass rate per replica against one router's, and predicted cached tokens
    against decode's; nothing for rows without `bypass_by_replica` (runs before it)."""
    out: list[str] = []
    for repeat in sorted({int(r.get("repeat") or 0) for r in rows}):
        mine = {str(r.get("front")): r for r in rows if int(r.get("repeat") or 0) == repeat}
        one, many = mine.get(EVENTS), mine.get(REPLICAS)
        if one is None or many is None or not one.get("bypass_by_replica") or not many.get("bypass_by_replica"):
            continue
        base = _rate(one["bypass_by_replica"][0])
        rates = [_rate(c) for c in many["bypass_by_replica"]]
        if base is None or not base or any(r is None for r in rates):
            out.append(f"- repeat {repeat}: bypass rate per replica not measured (no turns or no bypass)")
            continue
        got = [r for r in rates if r is not None]
        each = ", ".join(f"{_shown(c)}" for c in many["bypass_by_replica"])
        low = min(got) / base
        spread = (max(got) - min(got)) * 100
        out.append(
            f"- repeat {repeat}: bypassed turns per replica {each} against one router's"
            f" {_shown(one['bypass_by_replica'][0])}: lowest {low:.2f}x (target >= {RATE_TARGET}:"
            f" {'met' if low >= RATE_TARGET else 'not met'}), spread {spread:.1f} points (target <="
            f" {SPREAD_POINTS:.0f}: {'met' if spread <= SPREAD_POINTS else 'not met'})"
        )
        out += [_predicted(front, mine[front]) for front in (EVENTS, REPLICAS)]
        out += _same_route(many)
        out += _peer(mine)
    return out


def _p50(row: Row | None) -> float | None:
    found = ((row or {}).get("ttft_ms_turn2plus") or {}).get("p50")
    return float(found) if found is not None else None


def _peer(mine: Mapping[str, Row]) -> list[str]:
    """Turns >= 2 TTFT p50, kvpush's replicas against vllm-router kv_aware's replicas (loopback: <= 1.0x)."""
    ours, theirs = _p50(mine.get(REPLICAS)), _p50(mine.get(PEER_REPLICAS))
    if theirs is None:
        return []
    one = _p50(mine.get(PEER))
    shown = "not run" if one is None else f"{one:.1f} ms"
    line = f"  - vllm-router kv_aware turns >= 2 TTFT p50: {theirs:.1f} ms behind the replicas, {shown} behind one"
    if ours is None or not theirs:
        return [line]
    ratio = ours / theirs
    verdict = "met" if ratio <= LOOPBACK_TTFT_TARGET else "not met"
    return [f"{line}; kvpush's replicas {ours:.1f} ms: {ratio:.2f}x (loopback target <= 1.0: {verdict})"]


def _shown(counts: Mapping[str, int]) -> str:
    turns, bypass = counts.get("turns", 0), counts.get("bypass", 0)
    first, first_bypass = counts.get("first_turns", 0), counts.get("first_bypass", 0)
    return (
        f"{bypass} of {turns} (first turns {first_bypass} of {first}, later {bypass - first_bypass} of {turns - first})"
    )


def _same_route(row: Row) -> list[str]:
    """Each replica's turns routed as one router routed the same turn (nothing for rows without the field)."""
    found: Sequence[Mapping[str, int]] = row.get("same_route_as_one_router") or []
    if not found:
        return []
    each = ", ".join(f"{c.get('same', 0)} of {c.get('turns', 0)}" for c in found)
    met = all(c.get("same") == c.get("turns") for c in found)
    line = f"  - each replica's route against one router's on the same turn: {each} ({'all' if met else 'not all'})"
    if all("one_bypass" in c and c.get("turns") for c in found):  # runs since the field
        rates = [c["one_bypass"] / c["turns"] for c in found]
        shown = ", ".join(f"{c['one_bypass']} of {c['turns']}" for c in found)
        line += (
            f"; one router bypassed {shown} of the same turns (the rotation's own spread:"
            f" {(max(rates) - min(rates)) * 100:.1f} points)"
        )
    return [line]


def _predicted(front: str, row: Row) -> str:
    checks: Mapping[str, Any] = row.get("bypass_checks") or {}
    if checks:
        return _checked(front, checks)
    acc: Mapping[str, int] = row.get("bypass_accuracy") or {}
    if "predicted_cached" not in acc:
        return f"  - {front}: predicted cached tokens not read"
    predicted, actual = acc["predicted_cached"], acc.get("actual_cached", 0)
    verdict = "equal" if predicted == actual else f"differ by {predicted - actual:+d}"
    return (
        f"  - {front}: {acc.get('checked', 0)} checked bypasses predicted {predicted} cached tokens, decode"
        f" reported {actual} ({verdict}; summed: the router exposes no per-request prediction);"
        f" {acc.get('accurate', 0)} within 20 %"
    )


def _checked(front: str, checks: Mapping[str, Any]) -> str:
    """Request by request: each bypass's predicted uncached tokens against decode's computed tokens."""
    bypasses, checked, equal = checks.get("bypasses", 0), checks.get("checked", 0), checks.get("equal", 0)
    met = checked > 0 and equal == checked
    line = (
        f"  - {front}: {bypasses} bypasses, {checked} checked against decode's usage; predicted uncached tokens =="
        f" decode's computed tokens on {equal} of {checked} (target: every one: {'met' if met else 'not met'})"
    )
    if checks.get("differ"):
        line += "; differ (request, predicted, computed): " + ", ".join(str(tuple(d)) for d in checks["differ"])
    if checks.get("unchecked"):
        line += "; unchecked (no usage reached the decider): " + ", ".join(map(str, checks["unchecked"]))
    return line


def _stopped(found: Mapping[str, Any]) -> str:
    after = found.get("after_exit_s")
    verdict = "not met" if after is None or after > REFLECT_TARGET_S else "met"
    shown = "not within 10 s" if after is None else f"{after * 1000:.0f} ms"
    return (
        f"- a decode engine stopped at the end (SIGTERM, exited in {found.get('stop_s')} s; its views held"
        f" {found.get('held_blocks_before')} blocks): every replica's view of it empty {shown} after its exit"
        f" (target <= {REFLECT_TARGET_S:.0f} s: {verdict})"
    )


def _ratio_line(what: str, rows: Sequence[Row], ours: str, theirs: str, key: str, target: float, at_least: bool) -> str:
    per: dict[int, dict[str, float]] = {}
    for row in rows:
        value = row.get(key)
        if value is not None:
            per.setdefault(int(row.get("repeat") or 0), {})[str(row.get("front"))] = float(value)
    ratios = [f[ours] / f[theirs] for _, f in sorted(per.items()) if f.get(theirs) and ours in f]
    sign = ">=" if at_least else "<="
    if not ratios:
        return f"- {what}: not measured (target {sign} {target})"
    ratio = statistics.median(ratios)
    met = ratio >= target if at_least else ratio <= target
    each = ", ".join(f"{x:.2f}" for x in ratios)
    return f"- {what}: {ratio:.2f} (per repeat: {each}; target {sign} {target}: {'met' if met else 'not met'})"


def _consumed(front: str, row: Row) -> str:
    kv: Mapping[str, Any] = row.get("kv_events") or {}
    found: Mapping[str, Any] = row.get("reset_reflected") or {}
    reflected, step = found.get("total_s"), float(found.get("reset_and_step_s") or 0.0)
    reset = (
        "not measured"
        if not found
        else "not within 10 s (target <= 1 s: not met)"
        if reflected is None
        else f"{float(reflected) * 1000:.0f} ms after the reset asked (the reset and the one-token step that"
        f" publishes it answered in {step * 1000:.0f} ms; target <= {REFLECT_TARGET_S:.0f} s:"
        f" {'met' if float(reflected) <= REFLECT_TARGET_S else 'not met'})"
    )
    if not kv:
        return f"{front} (repeat {row.get('repeat')}): no KV events consumed; decode reset reflected: {reset}"
    return (
        f"{front} (repeat {row.get('repeat')}), per replica: {kv.get('events_per_s_per_replica')} events/s in"
        f" {kv.get('messages_per_s_per_replica')} messages/s; lag from the engine's stamp mean"
        f" {kv.get('lag_ms_mean')} ms, max {kv.get('lag_ms_max_so_far')} ms, {kv.get('frames.late', 0)} later than"
        f" 1 s; gaps {kv.get('sequence.gaps', 0)}, holes {kv.get('sequence.holes', 0)}, malformed"
        f" {kv.get('frames.malformed', 0)}; router CPU {row.get('router_cpu_ms_per_turn')} ms/turn;"
        f" decode reset reflected in every replica's view: {reset}"
    )
