"""The link row (issue 42 item 3) on bed `vllm-link`: every engine in its own namespace behind one shaped link,
KV over UCX TCP on it (stack.link), the router in the root namespace.

`link_cut`: with ten-block pushes under way, the link drops from 200 Mbit/s to the least it supports (100 kbit/s:
2000x slower, a ten-block push would take minutes: in effect a cut that keeps the veths up), stays there
`CUT_S`, and is restored. `link_slow`: the same at 2 Mbit/s (100x slower) for `SLOW_S`. Every client gets the
single instance's answer (p0 asked directly afterwards) or a clear error; the runner then checks that both sides
let go of the KV (observe())."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from loadtest.faults import client
from loadtest.faults.bed import LINK_RATE_BIT_S, Bed, Worker
from loadtest.faults.rows import FaultRow
from loadtest.faults.scenarios import FaultOutcome
from loadtest.faults.sustained import PREEMPT_WORDS, Answer, complete
from stack.link.plan import MIN_RATE_BIT_S, Shaping

CUT_S = 10.0
SLOW_S = 20.0  # at 2 Mbit/s three ten-block pushes (1 KiB of KV a token) need some 14 s of wire
CLIENTS = 3


def judge_link(answers: list[Answer], reference: dict[int, str | None], t_fault: float, note: str) -> FaultOutcome:
    """Pure: each answer equals the single instance's or is a clear error."""
    equal = sum(1 for i, a in enumerate(answers) if a.status == 200 and a.text == reference.get(i))
    differ = sum(1 for i, a in enumerate(answers) if a.status == 200 and a.text != reference.get(i))
    failed = [a for a in answers if a.status != 200]
    clear = Counter(f"{a.status} ({a.error})" for a in failed if a.status is not None and a.status >= 429 and a.error)
    unclear = len(failed) - sum(clear.values())
    counts = [("200 equal", equal), ("200 differ", differ), *sorted(clear.items()), ("unclear", unclear)]
    summary = ", ".join(f"{k} x{v}" for k, v in counts if v) or "no request ran"
    last = max((a.t_end for a in answers), default=t_fault)
    ok = bool(answers) and differ == 0 and unclear == 0
    return FaultOutcome(summary, ok, max(0.0, last - t_fault), note)


def _until_registered(decode: Worker, n: int, timeout: float = 30.0) -> None:
    """Until decode holds `n` requests (registered, waiting for their KV), or the timeout."""
    deadline = time.monotonic() + timeout
    with httpx.Client() as http:
        while time.monotonic() < deadline and (decode.state(http).running or 0) < n:
            time.sleep(0.02)


def link_cut(bed: Bed, row: FaultRow) -> FaultOutcome:
    return link_fault(bed, MIN_RATE_BIT_S, CUT_S)


def link_slow(bed: Bed, row: FaultRow) -> FaultOutcome:
    return link_fault(bed, LINK_RATE_BIT_S / 100, SLOW_S)


def link_fault(bed: Bed, rate_bit_s: float, hold_s: float) -> FaultOutcome:
    """The link at `rate_bit_s` for `hold_s` once decode holds every client's registration, then restored."""
    link = bed.link
    if link is None:
        return FaultOutcome("bed without a link", False, float("inf"))
    drops = link.drops()

    def make() -> dict[str, object]:
        return client.body(max_tokens=16, stream=False, words=PREEMPT_WORDS)

    with ThreadPoolExecutor(CLIENTS) as pool:
        pending = [pool.submit(complete, bed.router.url, make()) for _ in range(CLIENTS)]
        _until_registered(bed.decodes[0], CLIENTS)
        link.shape(Shaping.for_rate(rate_bit_s))
        t_fault = time.monotonic()
        try:
            time.sleep(hold_s)
        finally:
            link.shape(Shaping.for_rate(LINK_RATE_BIT_S))
        t_restored = time.monotonic()
        answers = [f.result() for f in pending]
    reference = {i: complete(bed.prefills[0].url, a.payload).text for i, a in enumerate(answers) if a.status == 200}
    note = (
        f"link at {rate_bit_s / 1e3:g} kbit/s for {t_restored - t_fault:.1f} s, then {LINK_RATE_BIT_S / 1e6:g} "
        f"Mbit/s again; shaper drops during the row: {link.drops() - drops}"
    )
    return judge_link(answers, reference, t_fault, note)


LINK: dict[str, Callable[[Bed, FaultRow], FaultOutcome]] = {"link-cut": link_cut, "link-slow": link_slow}
