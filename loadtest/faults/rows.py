"""The rows of the fault matrix: which fault, on what, on which bed. Pure data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Bed = Literal["vllm", "vllm-preempt", "vllm-tp", "vllm-dp", "vllm-dtp", "vllm-events", "vllm-link", "standin"]
Target = Literal["prefill", "decode", "client", "router"]


@dataclass(frozen=True)
class FaultRow:
    name: str
    target: Target
    fault: str  # the scenario that injects it (scenarios.SCENARIOS)
    bed: Bed
    deadline_s: float  # the longest fault-to-outcome time the row may show with default settings
    what: str  # one line for the table
    short: bool = True  # part of `--short` (make test)


# Order matters on the vLLM bed: the killed engines come last (nothing restarts them). A killed router replica is
# a second router the row starts itself: the bed's router and engines go on.
ROWS: tuple[FaultRow, ...] = (
    FaultRow("prefill 5xx", "prefill", "status500", "standin", 5.0, "one of two prefills answers 500 to every leg"),
    FaultRow("decode 5xx", "decode", "status500", "standin", 5.0, "one of two decodes answers 500 to every leg"),
    FaultRow(
        "prefill slow to read",
        "prefill",
        "slow-read",
        "standin",
        30.0,
        "a prefill reads a 64 KiB body at 10 KiB/s",
        short=False,
    ),
    FaultRow(
        "decode slow to read",
        "decode",
        "slow-read",
        "standin",
        30.0,
        "a decode reads a 64 KiB body at 10 KiB/s",
        short=False,
    ),
    FaultRow("prefill never reads", "prefill", "never-read", "standin", 10.0, "a prefill never reads an 8 MiB body"),
    FaultRow(
        "client leaves before first byte", "client", "leave-before-first-byte", "vllm", 5.0, "socket closed at once"
    ),
    FaultRow("client leaves mid-stream", "client", "leave-mid-stream", "vllm", 5.0, "socket closed after 3 events"),
    FaultRow(
        "client leaves mid-upload", "client", "leave-mid-upload", "vllm", 5.0, "10 KiB of a 1 MiB body, then closed"
    ),
    FaultRow(
        "slow reader",
        "client",
        "slow-reader",
        "vllm",
        60.0,
        "reads 512 B every 0.2 s with a 4 KiB receive buffer",
        short=False,
    ),
    FaultRow(
        "burst over admission", "client", "burst", "vllm", 30.0, "48 at once with max_in_flight 8, queue 8", short=False
    ),
    FaultRow(
        "lost registration",
        "decode",
        "lost-registration",
        "vllm",
        40.0,  # the bed's kv_timeout_s (30 s) and a margin
        "decode registers with a wrong engine id and side port",
        short=False,
    ),
    FaultRow(
        "router replica killed",
        "router",
        "replica-kill",
        "vllm",
        10.0,  # the survivor's clients finish well within it; the victim's see their cut at once
        "SIGKILL on one of two router replicas, streams in flight on both, steady load on the other",
        short=False,
    ),
    FaultRow("prefill hung", "prefill", "hang", "vllm", 5.0, "SIGSTOP on one of two prefills, requests in flight"),
    FaultRow("decode hung", "decode", "hang", "vllm", 5.0, "SIGSTOP on the only decode before its first byte"),
    FaultRow("prefill killed", "prefill", "kill", "vllm", 5.0, "SIGKILL on one of two prefills, requests in flight"),
    FaultRow(
        "decode killed", "decode", "kill", "vllm", 5.0, "SIGKILL on the only decode, streams in flight", short=False
    ),
    FaultRow(
        "prefill preempted under load",
        "prefill",
        "preempt-under-load",
        "vllm-preempt",
        120.0,  # the router's default decode first-byte deadline: the longest one request may take
        "a chunked prefill in a 16-block KV cache, 4 clients of ten-block prompts for 40 s: vLLM preempts legs"
        " after partial WRITEs",
        short=False,
    ),
    FaultRow(
        "prefill hung mid-push",
        "prefill",
        "hung-mid-push",
        "vllm-preempt",
        5.0,  # the router gives up on the hung prefill within seconds; decode's hold is the "settled" side
        "SIGSTOP on the only prefill after its first partial WRITE, kept stopped until decode frees the blocks",
        short=False,
    ),
    FaultRow(
        "prefill TP rank hung",
        "prefill",
        "tp-rank-hang",
        "vllm-tp",
        30.0,  # the bed's prefill deadline (20 s) and a margin
        "SIGSTOP on rank 1 of a TP=2 prefill (one of two prefills) while its legs are in flight, then SIGCONT",
        short=False,
    ),
    FaultRow(
        "prefill TP rank killed",
        "prefill",
        "tp-rank-kill",
        "vllm-tp",
        10.0,
        "SIGKILL on rank 1 of a TP=2 prefill (one of two prefills) while its legs' WRITEs are in flight",
        short=False,
    ),
    FaultRow(
        "prefill DP rank hung under load",
        "prefill",
        "dp-rank-hang",
        "vllm-dp",
        30.0,  # the bed's prefill deadline (20 s) and a margin
        "SIGSTOP on engine core 1 of a DP=2 prefill (one of two prefills) with its legs in flight, steady load at 70 %"
        " of capacity, then SIGCONT",
        short=False,
    ),
    FaultRow(
        "prefill DP rank killed under load",
        "prefill",
        "dp-rank-kill",
        "vllm-dp",
        10.0,
        "SIGKILL on engine core 1 of a DP=2 prefill (one of two prefills) with its legs in flight, steady load at 70 %"
        " of capacity",
        short=False,
    ),
    FaultRow(
        "decode TP rank killed under load",
        "decode",
        "decode-tp-rank-kill",
        "vllm-dtp",
        10.0,
        "SIGKILL on rank 1 of the only decode (TP=2) once it holds registered requests, steady load at 70 % of"
        " capacity",
        short=False,
    ),
    FaultRow(
        "KV events lost, publisher restarted",
        "router",
        "events-lost-restart",
        "vllm-events",
        60.0,  # the sessions' load (45 s) and a margin
        "two router replicas following the engines' KV events, sessions alternating them: decode's events relay"
        " drops a run of 20 messages, then restarts its publisher",
        short=False,
    ),
    FaultRow(
        "link cut mid-transfer",
        "prefill",
        "link-cut",
        "vllm-link",
        130.0,  # decode's first-byte deadline (120 s) and a margin: the longest a client may wait
        "the P/D link from 200 Mbit/s to 100 kbit/s for 10 s under three ten-block pushes, then restored",
        short=False,
    ),
    FaultRow(
        "link slowed 100x mid-transfer",
        "prefill",
        "link-slow",
        "vllm-link",
        130.0,  # decode's first-byte deadline (120 s) and a margin
        "the P/D link from 200 Mbit/s to 2 Mbit/s for 20 s under three ten-block pushes, then restored",
        short=False,
    ),
)


def selected(short: bool) -> tuple[FaultRow, ...]:
    return tuple(row for row in ROWS if row.short or not short)
