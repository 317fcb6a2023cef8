"""A request's exact prompt token ids in the router: what vLLM 0.32 computes for the same request, from the
model's own tokenizer folder (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`).

- Completions: the prompt text encoded with the post-processor's special tokens unless the request says
  `add_special_tokens: false`; a prompt sent as token ids is taken as it is.
- Chat: the template rendered as vLLM renders it (router/deciders/chat_render.py), then encoded without special
  tokens (unless the request asks for them).
None when the router cannot be sure (the shapes chat_render.py leaves out, batches, `suffix`, truncation).

Incremental: a tokenizer splits its input at its added tokens (`<|im_start|>`, `<|im_end|>` ...) before anything
else, so a prompt's ids are the ids of its pieces between them, in order. The pieces' ids are remembered (least
recently used first out, at most `memo_chars` characters: 8 Mi by default, ~2 M ids at 8 bytes each): a
conversation's next turn encodes only the pieces it adds (the new messages), and sessions that share a system
prompt encode it once. A text without added tokens (a completions transcript) is one piece; when it extends a
remembered long piece (more than `HEAD_CHARS`, found by its first `HEAD_CHARS` characters: the conversation's
previous prompt), the remembered ids are kept up to its second-to-last pre-token and only the rest is encoded
(`_encode_from`: a regex pre-tokenizer's matches before the last cannot change when text is appended).
Whether a tokenizer really splits that way is checked when it is loaded (extensions on a probe too) and then on
every `CHECK_EVERY`-th prompt (the whole text encoded again and compared): one difference turns the memo off for
good and is logged.

Cost, CPU time per request on the 2-core box under other agents' load (the tiny model's byte-level BPE, the
multiturn suite's conversations: a ~300-token system prompt, messages and answers of ~60 tokens; render + split
+ encode, the decider's lookup not included; median of 5 conversations,
`.venv/bin/python -m loadtest.bench.suites.multiturn.idcost`, Dec 7):

| prompt tokens | chat, next turn | completions, next turn | nothing remembered (first turn), chat / completions |
|---|---|---|---|
| ~1.0k | 0.16-0.44 ms | 0.19-0.20 ms | 1.25 / 1.14 ms |
| ~4.0k | 0.31-0.34 ms | 0.23-0.28 ms | 4.80 / 4.53 ms |
| ~16.1k | 0.97-1.24 ms | 0.52-0.61 ms | 19.8 / 21.6 ms |

(ranges: two runs; nothing remembered: the second. Before the extensions a completions next turn cost what
nothing remembered costs.)

Encoding costs ~1 µs per token; rendering the template 0.03-0.25 ms; a next turn pays for its own new text, the
split of the whole prompt and one hash per piece. The session-affinity decider's whole `decide` for a next turn
(ids, KV-event lookup on 3 workers, pick), same box, back to back with the estimate path on the same turn:
~1.3k tokens 0.28 ms (estimate 0.13), ~4.3k 0.61 ms (0.34), ~16.5k 2.9 ms (1.4).
"""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from router.deciders.chat_render import ChatTemplate
from router.deciders.tokenizer import read_tokenizer
from router.domain import Endpoint
from router.errors import ConfigError

logger = logging.getLogger("kvpush.decider")
CHECK_EVERY = 64
HEAD_CHARS = 256  # a piece longer than this may extend a remembered one with the same first characters
HEAD_KEEP = 16  # remembered long pieces per such head (sessions sharing a long opening)
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class PromptTokens:
    """The encoder of one model's prompts. Not thread-safe: the decider calls it on the router's loop."""

    def __init__(self, tokenizer: Any, template: ChatTemplate | None, memo_chars: int = 8 << 20) -> None:
        self._tokenizer = tokenizer
        self._template = template
        self._memo: OrderedDict[str, array[int]] = OrderedDict()  # 8 bytes per id
        self._memo_chars = memo_chars
        self._held_chars = 0
        self._seen = 0
        self.memo_on = True
        self.encoded_chars = 0  # characters the tokenizer encoded (memo misses): what the memo saves is visible
        self.extended = 0  # pieces encoded as a remembered piece they extend plus their new text
        self._resume: dict[str, tuple[int, int]] = {}  # long piece -> (char, token) an extension resumes from
        self._heads: dict[str, list[str]] = {}  # a long piece's first HEAD_CHARS -> such pieces, newest last
        self.extends_on = True
        added = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
        self._added = added
        pattern = "|".join(re.escape(text) for text in sorted(added, key=len, reverse=True) if text)
        self._splitter = re.compile(f"({pattern})") if pattern else None
        self._around = self._special_around()
        self._self_check()

    @classmethod
    def load(cls, where: str, memo_chars: int = 8 << 20) -> PromptTokens:
        """The folder holding `tokenizer.json` (or the file itself; then its folder's config and template)."""
        tokenizer, folder = read_tokenizer(where)
        config = _read_config(folder)
        source = _template_source(folder, config)
        template = ChatTemplate(source, _special_tokens(config)) if source is not None else None
        return cls(tokenizer, template, memo_chars)

    def memo_chars_held(self) -> int:
        return self._held_chars

    @property
    def has_template(self) -> bool:
        return self._template is not None

    def of(self, endpoint: Endpoint, body: Mapping[str, Any]) -> list[int] | None:
        """The request's prompt token ids as vLLM computes them; None when the router cannot be sure."""
        if body.get("truncate_prompt_tokens") is not None:
            return None
        if endpoint is Endpoint.CHAT:
            if self._template is None:
                return None
            text = self._template.render(body)
            return None if text is None else self.encode(text, body.get("add_special_tokens") is True)
        if endpoint is not Endpoint.COMPLETIONS or body.get("suffix") is not None:
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            return None
        return self.encode(prompt, body.get("add_special_tokens", True) is not False)

    def plain(self, text: str) -> list[int]:
        """`text` alone, no special tokens, no memo: what the engines' `/tokenize` gives for an answer check."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode(self, text: str, special: bool) -> list[int]:
        """`text`'s ids (with the post-processor's special tokens when `special`), piece by piece."""
        self._seen += 1
        if not self.memo_on or (special and self._around is None):
            return self._whole(text, special)
        ids = self._pieces(text)
        if special and self._around is not None:
            ids = [*self._around[0], *ids, *self._around[1]]
        if self._seen % CHECK_EVERY == 0:
            self._compare(text, special, ids)
        return ids

    def _pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        pieces = self._splitter.split(text) if self._splitter is not None else [text]
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(self._added[piece])
            elif piece:
                ids.extend(self._piece(piece))
        return ids

    def _piece(self, piece: str) -> array[int]:
        memo = self._memo
        found = memo.get(piece)
        if found is not None:
            memo.move_to_end(piece)
            return found
        start = self._extension_of(piece) if self.extends_on and len(piece) > HEAD_CHARS else None
        ids, resume = self._encode_from(piece, *(start or (0, array("q"))))
        if len(piece) <= self._memo_chars:
            memo[piece] = ids
            self._held_chars += len(piece)
            if resume is not None and len(piece) > HEAD_CHARS:
                self._resume[piece] = resume
                heads = self._heads.setdefault(piece[:HEAD_CHARS], [])
                heads.append(piece)
                if len(heads) > HEAD_KEEP:
                    self._resume.pop(heads.pop(0), None)
            while self._held_chars > self._memo_chars:
                self._drop(memo.popitem(last=False)[0])
        return ids

    def _extension_of(self, piece: str) -> tuple[int, array[int]] | None:
        """Where to resume encoding `piece` when it extends a remembered long piece (a completions prompt that
        grew by a turn): the char and the ids before it, from the longest such piece; None when none."""
        best = None
        for old in self._heads.get(piece[:HEAD_CHARS], ()):
            if len(old) < len(piece) and (best is None or len(old) > len(best)) and piece.startswith(old):
                best = old
        if best is None:
            return None
        at, tokens = self._resume[best]
        self.extended += 1
        return at, self._memo[best][:tokens]

    def _encode_from(self, piece: str, at: int, kept: array[int]) -> tuple[array[int], tuple[int, int] | None]:
        """`piece`'s ids: `kept` (the ids of `piece[:at]`, `at` a pre-token start) and `piece[at:]` encoded; with
        where an extension of `piece` may resume: the start of its second-to-last pre-token (the last one may
        grow or split when text is appended, the ones before it cannot: a regex pre-tokenizer matches left to
        right, each match decided by the text from its start to one past its end), checked by encoding from
        there again; else `at`'s own, else None."""
        encoding = self._tokenizer.encode(piece[at:], add_special_tokens=False)
        self.encoded_chars += len(piece) - at
        tail = encoding.ids
        ids = kept + array("q", tail)
        fallback = (at, len(kept)) if at else None
        if len(piece) <= HEAD_CHARS or not self.extends_on:
            return ids, fallback  # never extended: no resume point wanted
        last = encoding.token_to_word(len(tail) - 1) if tail else None
        if last is None or last < 1:
            return ids, fallback
        k = len(tail) - 1
        while k > 0 and (encoding.token_to_word(k - 1) or 0) >= last - 1:
            k -= 1  # back to the first token of the second-to-last pre-token
        chars = encoding.token_to_chars(k)
        if chars is None or chars[0] <= 0:
            return ids, fallback
        again = self._tokenizer.encode(piece[at + chars[0] :], add_special_tokens=False).ids
        if list(again) != list(tail[k:]):
            return ids, fallback
        return ids, (at + chars[0], len(kept) + k)

    def _drop(self, piece: str) -> None:
        self._held_chars -= len(piece)
        if self._resume.pop(piece, None) is not None:
            heads = self._heads.get(piece[:HEAD_CHARS], [])
            if piece in heads:
                heads.remove(piece)
            if not heads:
                self._heads.pop(piece[:HEAD_CHARS], None)

    def _whole(self, text: str, special: bool) -> list[int]:
        self.encoded_chars += len(text)
        return list(self._tokenizer.encode(text, add_special_tokens=special).ids)

    def _compare(self, text: str, special: bool, ids: Sequence[int]) -> None:
        whole = self._whole(text, special)
        if whole != list(ids):
            self.memo_on = False
            self._forget_all()
            logger.warning("prompt tokens: this tokenizer does not split at its added tokens; encoding whole prompts")

    def _forget_all(self) -> None:
        self._memo.clear()
        self._resume.clear()
        self._heads.clear()
        self._held_chars = 0

    def _special_around(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The ids the post-processor puts before and after a text's own (BOS ...); None when they are not a
        plain prefix and suffix."""
        plain = list(self._tokenizer.encode("a", add_special_tokens=False).ids)
        full = list(self._tokenizer.encode("a", add_special_tokens=True).ids)
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return tuple(full[:start]), tuple(full[start + len(plain) :])
        return None

    def _self_check(self) -> None:
        """The memo's assumption, on a probe holding every added token between ordinary text."""
        probe = " x\n".join(["hello", *self._added, " world  \n"])
        for special in (False, True):
            if self._around is None and special:
                continue
            self._compare(probe, special, self.encode(probe, special))
        if self.memo_on:
            self._check_extensions()
        self._seen = self.extended = 0

    def _check_extensions(self) -> None:
        """Extensions on a probe grown by endings that move the last pre-token's edge (a word going on, spaces
        then text, newlines, digits, non-ASCII): one difference from the whole text turns them off for good."""
        text = "Hello world, 12 apples; " * 12
        for more in ("foo", "bar baz", "  ", "\n\n", "x", "123", "45 é", "中文", " \t\n next", "!?", "'s end"):
            text += more
            if self._pieces(text) != self._whole(text, False):
                self.extends_on = False
                logger.warning("prompt tokens: an extended prompt's ids differ from the whole; encoding whole")
                break
        self._forget_all()


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        loaded = json.loads((folder / "tokenizer_config.json").read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise ConfigError(f"decider option tokenizer: cannot read {folder}/tokenizer_config.json: {error}") from None
    return loaded if isinstance(loaded, dict) else {}


def _template_source(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The model's default chat template: `chat_template.jinja` first (transformers 5), else the config's (a
    named list: its "default")."""
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    found = config.get("chat_template")
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, Mapping)}
        found = named.get("default")
    return found if isinstance(found, str) else None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for name in _SPECIAL_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out
