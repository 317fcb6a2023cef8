"""When a push connector posts its WRITEs, relative to P's engine steps (pure; one WritePlan per P leg).

Three connectors, three timings (issue 8, research turn2-connector.md sections 2.2 and 5):

  next-step        vLLM's NixlPushConnector: the finished prompt reaches the worker in the *next* step's
                   metadata, after that step's forward, so the WRITE leaves at the end of the step after the one
                   that completed the prompt (an idle P runs a no-forward step for it).
  completing-step  kvpush push: the worker's end-of-step hook of the step that computes the prompt's last token
                   posts the whole WRITE.
  per-step         kvpush progressive (chunked prefill): the blocks completed in each step are written at that
                   step's end; Done rides the final WRITE. A registration that arrives after the first chunk
                   was computed degrades to one whole-request WRITE in the completing step.

A WRITE is only posted once D has registered its blocks; a WRITE that became due earlier leaves at
registration. The driver calls `on_step_end` after every P step (not only the ones that touched the request),
`on_register` when D's registration arrives, and posts whatever they return, in order.
"""

import enum
from collections.abc import Callable
from dataclasses import dataclass

from loadtest.sim.link import Fifo


class WriteAt(enum.StrEnum):
    NEXT_STEP = "next-step"
    COMPLETING_STEP = "completing-step"
    PER_STEP = "per-step"


# the seed-sim rows' connector label -> when that connector posts its WRITE
CONNECTOR_WRITE_AT: dict[str, WriteAt] = {
    "upstream-push": WriteAt.NEXT_STEP,
    "kvpush-push": WriteAt.COMPLETING_STEP,
    "kvpush-progressive": WriteAt.PER_STEP,
}


@dataclass(frozen=True)
class PlannedWrite:
    """One WRITE: the KV of `tokens` prompt tokens; `final` carries Done (D's KV is complete when it lands)."""

    tokens: int
    final: bool


@dataclass
class WritePlan:
    mode: WriteAt
    prompt: int
    registered: bool = False
    computed: int = 0  # prompt tokens P has computed
    posted: int = 0  # prompt tokens already handed to the writer
    completed_at: int | None = None  # index of the step that computed the last prompt token
    due: bool = False  # the whole (remaining) prompt may be written now
    progressive: bool = True  # per-step only: False once degraded to a whole-request WRITE

    @property
    def finished(self) -> bool:
        return self.posted >= self.prompt

    @property
    def wants_step(self) -> bool:
        """next-step only: the prompt is complete and P must run one more step before the WRITE can leave."""
        return self.mode is WriteAt.NEXT_STEP and self.completed_at is not None and not self.due

    def on_step_end(self, index: int, computed: int) -> list[PlannedWrite]:
        """P's step `index` ended with `computed` prompt tokens of this request computed."""
        if self.finished:
            return []
        if computed > self.computed:
            self.computed = computed
            if computed >= self.prompt and self.completed_at is None:
                self.completed_at = index
        if self.mode is WriteAt.PER_STEP:
            if not self.registered and self.computed > 0:
                self.progressive = False
            if self.progressive:
                return self._post(self.computed)
        if self.completed_at is None:
            return []
        if self.mode is WriteAt.NEXT_STEP and index <= self.completed_at:
            return []
        self.due = True
        return self._post(self.prompt)

    def on_register(self) -> list[PlannedWrite]:
        """D's registration arrived (its blocks are allocated): post what is already due."""
        if self.registered:
            return []
        self.registered = True
        if self.mode is WriteAt.PER_STEP and self.computed > 0:
            self.progressive = False  # late: the computed blocks were not written step by step
        if self.mode is WriteAt.PER_STEP and self.progressive:
            return []
        if self.due or (self.mode is not WriteAt.NEXT_STEP and self.completed_at is not None):
            self.due = True
            return self._post(self.prompt)
        return []

    def _post(self, upto: int) -> list[PlannedWrite]:
        if not self.registered or upto <= self.posted:
            return []
        write = PlannedWrite(upto - self.posted, final=upto >= self.prompt)
        self.posted = upto
        return [write]


def stage(
    writes: list[PlannedWrite],
    now: float,
    writer: Fifo,
    setup_s: Callable[[int], float],
    transfer_s: Callable[[int], float],
    first_contact_s: float = 0.0,
) -> list[tuple[float, float, bool]]:
    """Queue `writes` on P's writer thread (descriptor setup): per write, (ready for the link, its seconds on
    the link alone, final). `first_contact_s` (a handshake) is paid once, by the first WRITE."""
    out = []
    for i, w in enumerate(writes):
        ready = writer.reserve(now, setup_s(w.tokens))
        out.append((ready, (first_contact_s if i == 0 else 0.0) + transfer_s(w.tokens), w.final))
    return out


def post(
    writes: list[PlannedWrite],
    now: float,
    writer: Fifo,
    link: Fifo,
    setup_s: Callable[[int], float],
    transfer_s: Callable[[int], float],
    first_contact_s: float = 0.0,
) -> float | None:
    """Queue `writes` on P's writer thread (descriptor setup) and then a FIFO link; when the final one lands.

    `first_contact_s` (a handshake) is paid once, by the first WRITE on the link. Returns None when none is final.
    """
    done: float | None = None
    for ready, seconds, final in stage(writes, now, writer, setup_s, transfer_s, first_contact_s):
        end = link.reserve(ready, seconds)
        if final:
            done = end
    return done
