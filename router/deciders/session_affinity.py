"""The session-affinity decider (router/decider.py holds the seam, router/deciders/registry.py the registry). Pure.

"session-affinity": multi-turn traffic stays where its KV is.
- Exact path (router/deciders/exact.py), taken first: with the engines' KV events followed, a prompt whose exact
  token ids are known (sent as ids, or computed by the router from the `tokenizer` option's folder:
  router/deciders/prompt_tokens.py) and every usable decode candidate's view caught up is decided on what the
  engines report holding of those ids: decode is the candidate holding the longest run of the prompt's blocks,
  BYPASS when what its cache serves and what it computes meet the two bypass options, else both legs on the
  holders. No learned ratio, index or answer check takes part: every replica following the same events decides
  the same, from a session's first turn (a shared system prompt is found because its blocks are held). Such a
  turn costs no conversation chain (its digests are the estimate's), so the learned index does not learn from
  it; the session table does.
- Everything below is the fallback: no tokenizer or no KV events, a shape the router does not render
  (router/deciders/chat_render.py), or a view not caught up.
- Decode: the healthy, not overloaded candidate that holds the longest prefix of the request (the index of what
  each worker was sent and generated), the session's last decode worker when it holds as much; with nothing held
  anywhere, the session's last worker; else the policy picks.
- BYPASS (no prefill leg) when that worker holds at least `bypass_min_cached_tokens` and the uncached suffix is
  estimated at most `bypass_max_uncached_tokens`: decode computes the suffix from its own prefix cache.
- Otherwise the router's mode (push or pull), with prefill on the candidate that holds the longest prefix (its
  cache holds earlier turns' prompts); none held: the policy picks.
- With the engines' KV events followed (router/kv_events), a worker whose view is caught up is judged by what its
  engine really holds: the tokens of the blocks the session's requests stored there (the router forwards the
  session id; vLLM tags each stored block with it), or, for a prompt sent as token ids, the longest prefix of
  those ids it holds. A learned match the events confirm is kept (it knows where in the prompt it ends); one
  they contradict (evicted, restarted, or never routed here by this replica) is replaced by what the events say,
  its position in the prompt placed at the message boundary its tokens reach (chat: `_at_message`) or estimated
  with the learned tokens-per-character ratio. Workers without a caught-up
  view, and prompts with neither a session nor token ids, keep the request-learned index (router/README.md,
  "KV events": why no tokenizer).
- An answer another replica relayed (the events place the held prefix past it) is checked only when this is a
  bypass candidate and a `tokenizer` is configured (`_answer_from_events`): its text, encoded in the router, is
  aligned with the token ids of the blocks the session stored last on that engine (its generated ids, from the
  KV events) and credited as far as the two agree, as the replica that relayed it checked it; nothing but the
  engines' events is shared between replicas.
- An answer is credited at first by `reusable_answer_tokens` (no tokenizer here). With `verify_answers` (the
  default) decode is asked for its generated token ids, and each answer is checked once it is relayed: decode
  tokenizes the text (router/retokenize.py) and the credit becomes exactly the generated tokens it re-tokenizes
  to, before the next turn comes (a random model's output often does not re-tokenize as generated).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from router import values
from router.decider import AnswerCheck, DeciderStats, Decision, Outcome, Route, Turn
from router.deciders.answer_align import align, assistant_text
from router.deciders.conversation import Chain, ChainLink, ConversationKey, conversation_key, session_of
from router.deciders.exact import ExactPick, exact_pick
from router.deciders.prefix_index import Match, PrefixIndex, SessionTable, TokenRatio, prorated, reusable_answer_tokens
from router.deciders.prompt_tokens import PromptTokens
from router.deciders.tokenizer import Tokenize
from router.domain import Endpoint, WorkerView
from router.errors import ConfigError
from router.kv_events.view import KvEventView

logger = logging.getLogger("kvpush.decider")
ACCURATE = 0.2  # a bypass prediction is "accurate" when uncached tokens are within 20 % of the actual
PLACE_SLACK = 0.25  # how far the tokens-per-character estimate of a held chat prefix may be off (_at_message)
BLOCK_SLACK = 16  # tokens searched either side of an answer's estimated start, beyond PLACE_SLACK of the estimate
MISS_WINDOW, MISS_LIMIT = 16, 4  # this many of the last checked bypasses holding under half the predicted cache:
# the answers the router relays are not what the engines cache (e.g. reasoning the relay does not show), so
# generated text stops being credited


@dataclass(frozen=True)
class AffinityOptions:
    """The `decider:` block's options for "session-affinity" (all optional)."""

    bypass_max_uncached_tokens: int = 256  # bypass when decode lacks at most this many prompt tokens
    bypass_min_cached_tokens: int = 64  # ... and holds at least this many (a first turn is never bypassed)
    overload_in_flight_gap: int = 8  # a worker with this many more legs in flight than the least busy is skipped
    overload_engine_waiting: int = 8  # ... as is one whose engine queues this many (when its load is scraped)
    ttl_s: float = 300.0  # keep below the engines' prefix-cache eviction horizon
    max_links_per_worker: int = 200_000  # index bound per worker (a chat turn adds one link per message)
    max_sessions: int = 100_000
    chunk_chars: int = 256  # completions: one link per this many prompt characters
    chars_per_token: float = 4.0  # the first guess, replaced by what the engines report
    block_tokens: int = 16  # the engines' KV block size (--block-size; vLLM's CPU backend defaults to 128):
    # a prefix cache holds whole blocks only
    verify_answers: bool = True  # ask decode for the answer's token ids and check what its text re-tokenizes to
    tokenizer: str | None = None  # the model's tokenizer folder (tokenizer.json, tokenizer_config.json, its chat
    # template): with KV events, requests are decided on their exact prompt ids (router/deciders/prompt_tokens.py,
    # exact.py); on the estimate path, an answer another replica relayed is checked against the engine's stored
    # ids before a bypass (router/deciders/tokenizer.py)

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> AffinityOptions:
        """The options checked by router/values.py's rules, as the policies' are (ConfigError names the option)."""
        unknown = sorted(set(options) - set(_RULES) - {"name"})
        if unknown:
            raise ConfigError(f"decider session-affinity: unknown option(s) {unknown}; known: {sorted(_RULES)}")
        where = "decider session-affinity"
        return cls(**{k: _RULES[k](v, f"{where}: {k}") for k, v in options.items() if k != "name"})


def prompt_token_ids(body: Mapping[str, Any]) -> list[int] | None:
    """A completions prompt sent as token ids (one prompt: a list of ints, or a batch of one such list)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def _at_least(low: int) -> Callable[[Any, str], int]:
    return lambda value, where: values.integer(value, where, low=low)


_RULES: dict[str, Callable[[Any, str], Any]] = {
    "bypass_max_uncached_tokens": _at_least(0),
    "bypass_min_cached_tokens": _at_least(0),
    "overload_in_flight_gap": _at_least(1),
    "overload_engine_waiting": _at_least(1),
    "ttl_s": values.seconds,
    "max_links_per_worker": _at_least(1),
    "max_sessions": _at_least(1),
    "chunk_chars": _at_least(1),
    "chars_per_token": values.positive,
    "block_tokens": _at_least(1),
    "verify_answers": values.boolean,
    "tokenizer": values.text,
}


@dataclass(frozen=True)
class _Plan:
    """What `decide` worked out, handed back in `record`."""

    key: ConversationKey
    predicted_uncached: int
    held: Match | None = None  # the prefix decode was found holding
    exact: bool = False  # decided on the prompt's exact ids and the KV events (router/deciders/exact.py)


@dataclass
class _Counters:
    decisions: dict[str, int] = field(default_factory=lambda: {str(r): 0 for r in Route})
    predicted_cached_tokens: int = 0
    actual_cached_tokens: int = 0
    checked_bypasses: int = 0
    accurate_bypasses: int = 0
    recent_misses: list[bool] = field(default_factory=list)
    answers_checked: int = 0  # answers whose re-tokenization decode reported
    answers_short: int = 0  # ... and re-tokenized to fewer of the generated tokens than were credited
    event_decisions: int = 0  # decisions whose decode pick a caught-up KV-event view judged
    event_corrections: int = 0  # learned matches the KV events cut down (evicted, restarted, elsewhere)
    event_matches: int = 0  # matches only the KV events knew of (e.g. another replica routed the session)
    event_answer_checks: int = 0  # answers another replica relayed, checked against the engine's stored ids


class SessionAffinity:
    name: ClassVar[str] = "session-affinity"
    wants_answer = True
    wants_headers = True  # the session id header keys the conversation

    def __init__(
        self,
        options: AffinityOptions | None = None,
        view: KvEventView | None = None,
        tokenize: Tokenize | None = None,
        prompt_tokens: PromptTokens | None = None,
    ) -> None:
        self.options = o = options or AffinityOptions()
        self.view = view  # the engines' KV events (None: off); read on the router's loop, like everything here
        self.tokenize = tokenize  # text -> token ids (the `tokenizer` option): answers other replicas relayed
        self.prompt_tokens = prompt_tokens  # a request's exact prompt ids (the `tokenizer` option): the exact path
        self.decode_index = PrefixIndex(o.max_links_per_worker, o.ttl_s)
        self.prefill_index = PrefixIndex(o.max_links_per_worker, o.ttl_s)
        self.sessions = SessionTable(o.max_sessions, o.ttl_s)
        self.ratio = TokenRatio(1.0 / o.chars_per_token)  # whole prompts: for what the index has no count of
        self.suffix_ratio = TokenRatio(1.0 / o.chars_per_token)  # what turns add beyond a held prefix: predicts it
        self.answers_trusted = True  # generated text is credited as held on decode (until bypasses prove wrong)
        self.wants_token_ids = o.verify_answers
        self._counts = _Counters()

    @classmethod
    def from_options(cls, options: Mapping[str, Any], view: KvEventView | None = None) -> SessionAffinity:
        o = AffinityOptions.from_mapping(options)
        if o.tokenizer is None or view is None:
            return cls(o, view)
        tokens = PromptTokens.load(o.tokenizer)  # the file read once, for answer checks and exact prompt ids
        return cls(o, view, tokens.plain, tokens)

    def decide(self, turn: Turn, decode: Sequence[WorkerView], prefill: Sequence[WorkerView], now: float) -> Decision:
        ids = prompt_token_ids(turn.body) if self.view is not None else None
        usable = self._usable(decode)
        exact = self._exact(turn, ids, usable, prefill)
        if exact is not None:  # the chain is the estimate's: not built (the learned index learns nothing here)
            session = ConversationKey(session_of(turn.body, turn.headers), Chain(turn.info.endpoint, ()))
            return self._decide_exact(turn, session, exact, usable, now)
        key = conversation_key(turn.info.endpoint, turn.body, turn.headers, self.options.chunk_chars)
        truth = self._truth(key, ids, usable)
        held = self._pick_decode(key, usable, now, truth)
        cached, uncached = self._predict(key.chain, ids, held)
        if held is not None and ids is None and self._bypassable(cached, uncached):
            checked = self._answer_from_events(turn, key, held, now)
            if checked is not None:
                held = checked
                cached, uncached = self._predict(key.chain, ids, held)
        if held is not None and self._bypassable(cached, uncached):
            return self._count(
                Decision(Route.BYPASS, held.worker, None, cached, "decode holds all but a short suffix"),
                key,
                uncached,
                held,
            )
        route = Route.of(turn.mode)
        warm_usable = self._usable(prefill)
        warm = self._longest(self.prefill_index, key.chain, warm_usable, now, self._truth(key, ids, warm_usable))
        reason = "session or prefix on decode" if held is not None else "no affinity"
        return self._count(
            Decision(route, held.worker if held else None, warm.worker if warm else None, cached, reason),
            key,
            uncached,
            held,
        )

    def _exact(
        self, turn: Turn, ids: list[int] | None, usable: Sequence[WorkerView], prefill: Sequence[WorkerView]
    ) -> ExactPick | None:
        """The pick on the prompt's exact ids (sent as ids, or computed by the router's tokenizer) when every
        usable decode candidate's KV-event view is caught up; None: the estimate decides."""
        view = self.view
        if view is None:
            return None
        if ids is None and self.prompt_tokens is not None:
            ids = self.prompt_tokens.of(turn.info.endpoint, turn.body)
        if not ids:
            return None
        return exact_pick(view, ids, [w.id for w in usable], [w.id for w in self._usable(prefill)])

    def _decide_exact(
        self, turn: Turn, key: ConversationKey, pick: ExactPick, usable: Sequence[WorkerView], now: float
    ) -> Decision:
        """Bypass when the decode holding the longest prefix computes at most `bypass_max_uncached_tokens` and
        serves at least `bypass_min_cached_tokens` from its cache; else both legs on the holders (none held: the
        session's last decode, else the policy's)."""
        self._counts.event_decisions += 1
        cached, uncached = pick.cached, pick.uncached
        if pick.decode is not None and self._bypassable(cached, uncached):
            reason = "decode holds all but a short suffix (exact)"
            return self._count(Decision(Route.BYPASS, pick.decode, None, cached, reason), key, uncached, None, True)
        worker = pick.decode
        if worker is None and key.session is not None:
            last = self.sessions.get(key.session, now)
            worker = last if any(w.id == last for w in usable) else None
        reason = "prefix on decode (exact)" if pick.decode is not None else "no prefix held (exact)"
        decision = Decision(Route.of(turn.mode), worker, pick.prefill, cached if pick.decode else 0, reason)
        return self._count(decision, key, uncached, None, True)

    def _predict(self, chain: Chain, ids: Sequence[int] | None, held: Match | None) -> tuple[int, int]:
        """(cached, uncached) tokens of the prompt on the decode holding `held`: whole blocks only are cached."""
        bt = self.options.block_tokens
        cached = (held.reusable // bt) * bt if held is not None else 0
        if ids is not None:
            return cached, len(ids) - cached
        return cached, self._uncached(chain, held) + (held.tokens - cached if held is not None else 0)

    def _bypassable(self, cached: int, uncached: int) -> bool:
        o = self.options
        return cached >= o.bypass_min_cached_tokens and uncached <= o.bypass_max_uncached_tokens

    def _answer_from_events(self, turn: Turn, key: ConversationKey, held: Match, now: float) -> Match | None:
        """`held` with the answer just before it checked, when another replica relayed that answer (this replica's
        own index ends before `held`) and the engine's KV events hold the session's last stored blocks: the
        answer's text, encoded here, is aligned with those blocks' token ids (its generated ids) near where the
        prompt's estimate puts its start, and the prefix held is where they part (whole blocks). None: nothing to
        check (no tokenizer, this replica's own answer, not an answer, no tip held)."""
        view, tokenize, chain = self.view, self.tokenize, key.chain
        if view is None or tokenize is None or key.session is None or chain.endpoint is not Endpoint.CHAT:
            return None
        learned = self.decode_index.longest(held.worker, chain, now)
        at = next((i for i, link in enumerate(chain.links) if link.chars == held.chars), 0)
        text = assistant_text(turn.body, at - 1)
        if held.chars <= learned.chars or at < 2 or text is None:
            return None
        tail = view.session_tail(held.worker, key.session)
        if tail is None:
            return None
        answer = tokenize(text)
        anchor = learned if learned.tokens > 0 else None
        guess = self._tokens_at(chain.links[at - 1].chars, anchor)
        slack = BLOCK_SLACK + round(PLACE_SLACK * (guess - (anchor.tokens if anchor is not None else 0)))
        start, agreed = align(tail, answer, guess, slack)
        reached = min(tail.end, start + agreed)
        self._counts.event_answer_checks += 1
        return Match(held.worker, 0, held.chars, start + len(answer), (reached // tail.block_size) * tail.block_size)

    def record(self, turn: Turn, decision: Decision, outcome: Outcome, now: float) -> AnswerCheck | None:
        plan = decision.state
        if not isinstance(plan, _Plan):
            return None
        if not outcome.ok:  # a failed attempt tells nothing certain about what a cache holds; but a client that
            if _checkable(decision, outcome):  # left after decode's usage (client_gone) still shows its count
                _log_bypass(turn, decision, plan, outcome)
            return None
        chain = plan.key.chain
        if outcome.prompt_tokens is not None:
            self.ratio.learn(outcome.prompt_tokens, chain.chars)
            if plan.held is not None and plan.held.chars > 0:  # what this turn added beyond the prefix held
                self.suffix_ratio.learn(outcome.prompt_tokens - plan.held.tokens, chain.chars - plan.held.chars)
        tokens = outcome.prompt_tokens if outcome.prompt_tokens is not None else self.ratio.tokens(chain.chars)
        prompt_counts = prorated(chain.links, chain.chars, tokens)
        if outcome.prefill is not None:
            self.prefill_index.record(outcome.prefill, chain.links, prompt_counts, now)
        held_links, held_counts, reusable = list(chain.links), prompt_counts, tokens
        check: AnswerCheck | None = None
        if outcome.answer is not None and chain.links and self.answers_trusted:
            grown = chain.extend(outcome.answer)
            generated = outcome.completion_tokens
            if generated is None:
                generated = self.ratio.tokens(len(outcome.answer))
            total = tokens + generated
            extra = grown.links[len(chain.links) :]
            base = chain.chars
            held_links = [*chain.links, *extra]
            spread = [tokens + round((total - tokens) * (x.chars - base) / max(1, grown.chars - base)) for x in extra]
            held_counts = [*prompt_counts, *spread]
            credited = reusable_answer_tokens(outcome.answer, generated)
            reusable = tokens + credited
            check = self._answer_check(outcome, extra, spread, tokens, credited, now)
        self.decode_index.record(outcome.decode, held_links, held_counts, now, reusable)
        if plan.key.session is not None:
            self.sessions.set(plan.key.session, outcome.decode, now)
        if self._check_prediction(decision, plan, outcome):
            _log_bypass(turn, decision, plan, outcome)
        return check

    def _answer_check(
        self,
        outcome: Outcome,
        links: Sequence[ChainLink],
        counts: Sequence[int],
        prompt_tokens: int,
        credited: int,
        recorded_at: float,
    ) -> AnswerCheck | None:
        """The check of an answer whose generated ids came whole (as many as usage counts)."""
        ids, answer = outcome.answer_token_ids, outcome.answer
        if not self.wants_token_ids or ids is None or answer is None or not links:
            return None
        if outcome.completion_tokens is not None and len(ids) != outcome.completion_tokens:
            return None
        worker, held, generated = outcome.decode, tuple(links), len(ids)

        def settle(matched: int, count: int, now: float) -> None:
            """The answer's links sit `count` re-tokenized tokens past the prompt, `matched` of them cached."""
            c = self._counts
            c.answers_checked += 1
            c.answers_short += matched < credited
            at = [prompt_tokens + round((n - prompt_tokens) * count / generated) for n in counts]
            self.decode_index.refine(worker, held, recorded_at, prompt_tokens + matched, at)

        return AnswerCheck(worker, answer, ids, settle)

    def forget(self, worker_id: str) -> None:
        self.decode_index.forget(worker_id)
        self.prefill_index.forget(worker_id)
        self.sessions.forget(worker_id)

    def stats(self) -> DeciderStats:
        c = self._counts
        d, p, s = self.decode_index.evictions, self.prefill_index.evictions, self.sessions.evictions
        evictions = {}
        for role, ev in (("decode", d), ("prefill", p), ("sessions", s)):
            for cause, n in dataclasses.asdict(ev).items():
                evictions[f"{role}/{cause}"] = n
        return DeciderStats(
            decisions=dict(c.decisions),
            index_links={"decode": len(self.decode_index), "prefill": len(self.prefill_index)},
            sessions=len(self.sessions),
            evictions=evictions,
            predicted_cached_tokens=c.predicted_cached_tokens,
            actual_cached_tokens=c.actual_cached_tokens,
            checked_bypasses=c.checked_bypasses,
            accurate_bypasses=c.accurate_bypasses,
            tokens_per_char=self.ratio.value,
            answers_trusted=self.answers_trusted,
            answers_checked=c.answers_checked,
            answers_short=c.answers_short,
            event_decisions=c.event_decisions,
            event_corrections=c.event_corrections,
            event_matches=c.event_matches,
            event_answer_checks=c.event_answer_checks,
        )

    def _usable(self, workers: Sequence[WorkerView]) -> list[WorkerView]:
        """The candidates that are not clearly overloaded (all of them if every one is)."""
        if not workers:
            return []
        least = min(w.in_flight for w in workers)
        o = self.options
        calm = [
            w
            for w in workers
            if w.in_flight - least < o.overload_in_flight_gap
            and not (w.load_known and w.engine_waiting >= o.overload_engine_waiting)
        ]
        return calm or list(workers)

    def _pick_decode(
        self, key: ConversationKey, usable: Sequence[WorkerView], now: float, truth: Mapping[str, int]
    ) -> Match | None:
        if truth:
            self._counts.event_decisions += 1
        best = self._longest(self.decode_index, key.chain, usable, now, truth, count=True)
        last = self.sessions.get(key.session, now) if key.session is not None else None
        if last is not None and any(w.id == last for w in usable):
            mine = self._reconcile(self.decode_index.longest(last, key.chain, now), key.chain, truth)
            if best is None or mine.reusable >= best.reusable:
                return mine
        return best

    def _longest(
        self,
        index: PrefixIndex,
        chain: Chain,
        usable: Sequence[WorkerView],
        now: float,
        truth: Mapping[str, int],
        *,
        count: bool = False,
    ) -> Match | None:
        """The worker holding the longest prefix (ties: configuration order); None when none holds any. A worker
        in `truth` (its KV-event view is caught up) is judged by it (`_reconcile`)."""
        found = []
        for w in usable:
            learned = index.longest(w.id, chain, now)
            judged = self._reconcile(learned, chain, truth)
            if count and judged is not learned:
                self._counts.event_corrections += judged.reusable < learned.reusable
                self._counts.event_matches += learned.tokens == 0 and judged.tokens > 0
            found.append(judged)
        best = max(found, key=lambda m: m.reusable, default=None)
        return best if best is not None and best.tokens > 0 else None

    def _truth(self, key: ConversationKey, ids: Sequence[int] | None, usable: Sequence[WorkerView]) -> dict[str, int]:
        """Per candidate whose KV-event view is caught up, the tokens of this prompt its engine holds: the longest
        held prefix of the token ids, or the session's blocks held there; empty when the events cannot say."""
        view = self.view
        if view is None or (ids is None and key.session is None):
            return {}
        up = [w.id for w in usable if view.caught_up(w.id)]
        if not up:
            return {}
        if ids is not None:
            return {worker: held.tokens for worker, held in view.held_prefixes(ids, up).items()}
        assert key.session is not None
        tokens = view.session_tokens(key.session)
        return {worker: tokens.get(worker, 0) for worker in up}

    def _reconcile(self, learned: Match, chain: Chain, truth: Mapping[str, int]) -> Match:
        """`learned` as the worker's KV events judge it: kept when the engine holds at least its whole blocks (a
        chat prompt's held prefix moved further on when the engine holds a block or more beyond it), else what
        the engine holds, placed in the prompt by the learned ratio (at most the whole prompt; the
        tokens are the engine's, which a next turn extending the session finds whole)."""
        held = truth.get(learned.worker)
        if held is None:
            return learned
        bt = self.options.block_tokens
        if learned.tokens > 0 and held >= (learned.reusable // bt) * bt:
            if held >= learned.reusable + bt and chain.endpoint is Endpoint.CHAT and chain.links:
                # the engine holds more than this replica saw (another replica served the turns since)
                placed = self._at_message(learned.worker, chain, held, anchor=learned)
                return placed if placed.chars > learned.chars else learned
            return learned
        if held <= 0:
            return Match(learned.worker, 0, 0, 0, 0)
        if chain.endpoint is Endpoint.CHAT and chain.links:
            return self._at_message(learned.worker, chain, held)
        chars = min(chain.chars, round(held / self.ratio.value)) if chain.links else 0
        return Match(learned.worker, 0, chars, held, held)

    def _at_message(self, worker: str, chain: Chain, held: int, anchor: Match | None = None) -> Match:
        """A chat prompt whose engine holds `held` tokens (whole blocks) of the session that this replica has no
        count of (another replica served the turns before): a session's blocks are its earlier prompts and
        answers, so the held prefix ends at a message boundary before the new last message, the last one whose
        estimated tokens are within `PLACE_SLACK` of `held` plus a block. Past `held` the engine computed the
        tokens up to that boundary that fill no whole block: estimated as the boundary's tokens less `held`
        (0 to a block), the boundary's tokens counted from `anchor` (this replica's own match, exact up to its
        end) where there is one. The suffix is then predicted from the boundary on, as for a learned match,
        rather than as the whole prompt's estimate less `held`, whose error (a few percent of a long prompt) can
        exceed a short suffix. No boundary that near (blocks evicted): placed by the ratio."""
        bt = self.options.block_tokens
        reach = (held + bt) * (1 + PLACE_SLACK)
        fits = [link for link in chain.links[:-1] or chain.links if self._tokens_at(link.chars, anchor) <= reach]
        if not fits:
            return Match(worker, 0, min(chain.chars, round(held / self.ratio.value)), held, held)
        at = fits[-1].chars
        rest = min(bt - 1, max(0, self._tokens_at(at, anchor) - held))
        return Match(worker, 0, at, held + rest, held)

    def _tokens_at(self, chars: int, anchor: Match | None) -> int:
        """The prompt's tokens up to `chars`: from the anchor's exact count on when it ends before, else the
        ratio's estimate of the whole."""
        if anchor is None or anchor.tokens <= 0 or anchor.chars > chars:
            return self.ratio.tokens(chars)
        ratio = self.suffix_ratio if self.suffix_ratio.samples else self.ratio
        return anchor.tokens + ratio.tokens(chars - anchor.chars)

    def _uncached(self, chain: Chain, held: Match | None) -> int:
        if held is None:
            return self.ratio.tokens(chain.chars)
        ratio = self.suffix_ratio if self.suffix_ratio.samples else self.ratio
        return ratio.tokens(max(0, chain.chars - held.chars))

    def _count(
        self, decision: Decision, key: ConversationKey, uncached: int, held: Match | None, exact: bool = False
    ) -> Decision:
        self._counts.decisions[str(decision.route)] += 1
        return dataclasses.replace(decision, state=_Plan(key, uncached, held, exact))

    def _check_prediction(self, decision: Decision, plan: _Plan, outcome: Outcome) -> bool:
        """Predicted vs actual, on bypasses only: there decode's usage counts its own prefix-cache hits (in push
        mode decode reports transferred tokens as cached, so its figure says nothing about the prediction).
        False: nothing to check."""
        if decision.route is not Route.BYPASS or outcome.cached_tokens is None or outcome.prompt_tokens is None:
            return False
        c = self._counts
        c.predicted_cached_tokens += decision.predicted_cached_tokens
        c.actual_cached_tokens += outcome.cached_tokens
        c.checked_bypasses += 1
        actual = outcome.prompt_tokens - outcome.cached_tokens
        if abs(plan.predicted_uncached - actual) <= ACCURATE * max(actual, 1):
            c.accurate_bypasses += 1
        c.recent_misses = [*c.recent_misses, 2 * outcome.cached_tokens < decision.predicted_cached_tokens][
            -MISS_WINDOW:
        ]
        if self.answers_trusted and sum(c.recent_misses) >= MISS_LIMIT:
            self.answers_trusted = False
            logger.warning(
                "decider %s: %d of the last %d bypasses found under half the predicted prefix cached on decode; "
                "generated text is no longer credited as cached (is reasoning or tool-call output stripped?)",
                self.name,
                sum(c.recent_misses),
                len(c.recent_misses),
            )
        return True


def _checkable(decision: Decision, outcome: Outcome) -> bool:
    """A bypass whose usage reported decode's prompt and cached tokens."""
    return decision.route is Route.BYPASS and outcome.cached_tokens is not None and outcome.prompt_tokens is not None


def _log_bypass(turn: Turn, decision: Decision, plan: _Plan, outcome: Outcome) -> None:
    """One line per checked bypass (INFO): what was predicted and what decode reported, under the client's
    x-request-id, so "predicted uncached tokens equal decode's computed tokens" is checkable bypass by bypass."""
    prompt, cached = outcome.prompt_tokens or 0, outcome.cached_tokens or 0
    fields = {
        "request_id": turn.headers.get("x-request-id"),
        "ok": outcome.ok,  # False: the client left after decode's usage (not counted in the bypass counters)
        "decode": outcome.decode,
        "exact": plan.exact,
        "predicted_cached_tokens": decision.predicted_cached_tokens,
        "predicted_uncached_tokens": plan.predicted_uncached,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": prompt - cached,
    }
    logger.info(
        "bypass checked: predicted %d uncached, decode computed %d",
        plan.predicted_uncached,
        prompt - cached,
        extra={"fields": fields},
    )
