"""Exact prompt ids in the router: equal to the tokenizer encoding the whole rendered prompt, computed piece by
piece between the added tokens, each piece encoded once (a next turn encodes only what it adds)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from router.deciders.chat_render import ChatTemplate
from router.deciders.prompt_tokens import CHECK_EVERY, PromptTokens
from router.domain import Endpoint
from router.errors import ConfigError

SPECIAL = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "",
    "def",
    "return",
    "None\n\tif",
    "x:",
    "y",
    "=",
    "1",
    "#",
    "héllo",
    "12345",
    "",
]


def corpus(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def trained() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([corpus(i, 200) for i in range(20)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    return tok


def folder(tmp_path: Path) -> Path:
    trained().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "chat_template": TEMPLATE}))
    return tmp_path


def chat(turns: int, seed: int = 1) -> dict[str, Any]:
    messages = [{"role": "system", "content": corpus(seed, 40)}]
    for t in range(turns):
        messages.append({"role": "user", "content": corpus(seed * 100 + t, 30)})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": corpus(seed * 1000 + t, 20)})
    return {"messages": messages}


def test_chat_ids_equal_the_whole_rendered_prompt_encoded(tmp_path: Path) -> None:
    prompt = PromptTokens.load(str(folder(tmp_path)))
    whole = trained()
    template = ChatTemplate(TEMPLATE, {"bos_token": "<|bos|>"})
    for turns in range(1, 6):
        body = chat(turns)
        text = template.render(body)
        assert text is not None
        assert prompt.of(Endpoint.CHAT, body) == whole.encode(text, add_special_tokens=False).ids
    assert prompt.memo_on


def test_a_next_turn_encodes_only_what_it_adds(tmp_path: Path) -> None:
    prompt = PromptTokens.load(str(folder(tmp_path)))
    prompt.of(Endpoint.CHAT, chat(3))
    before = prompt.encoded_chars
    grown = chat(4)
    prompt.of(Endpoint.CHAT, grown)
    added = grown["messages"][-2:]  # the answer sent back and the new question
    assert prompt.encoded_chars - before == sum(len(m["role"]) + 1 + len(m["content"]) for m in added)
    # another session sharing the system prompt finds it remembered
    other = {"messages": [chat(1)["messages"][0], {"role": "user", "content": "new"}]}
    before = prompt.encoded_chars
    prompt.of(Endpoint.CHAT, other)
    assert prompt.encoded_chars - before == len("user\nnew")


def test_completions_with_and_without_special_tokens_and_as_token_ids(tmp_path: Path) -> None:
    prompt = PromptTokens.load(str(folder(tmp_path)))
    whole = trained()
    text = corpus(7, 50)
    assert prompt.of(Endpoint.COMPLETIONS, {"prompt": text}) == whole.encode(text).ids
    assert prompt.of(Endpoint.COMPLETIONS, {"prompt": [text]})[0] == 0  # type: ignore[index]
    unspecial = prompt.of(Endpoint.COMPLETIONS, {"prompt": text, "add_special_tokens": False})
    assert unspecial == whole.encode(text, add_special_tokens=False).ids
    assert prompt.of(Endpoint.COMPLETIONS, {"prompt": [5, 6, 7]}) == [5, 6, 7]
    chat_special = prompt.of(Endpoint.CHAT, {**chat(1), "add_special_tokens": True})
    assert chat_special is not None and chat_special[:2] == [0, 0]  # BOS from the template and from the tokenizer


@pytest.mark.parametrize(
    "endpoint,body",
    [
        (Endpoint.COMPLETIONS, {"prompt": "x", "suffix": "y"}),
        (Endpoint.COMPLETIONS, {"prompt": ["a", "b"]}),
        (Endpoint.COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 4}),
        (Endpoint.CHAT, {"messages": [{"role": "developer", "content": "x"}]}),
    ],
)
def test_what_the_router_cannot_be_sure_of_has_no_ids(tmp_path: Path, endpoint: Endpoint, body: Any) -> None:
    assert PromptTokens.load(str(folder(tmp_path))).of(endpoint, body) is None


def test_without_a_template_chat_has_no_ids(tmp_path: Path) -> None:
    trained().save(str(tmp_path / "tokenizer.json"))
    prompt = PromptTokens.load(str(tmp_path / "tokenizer.json"))
    assert not prompt.has_template
    assert prompt.of(Endpoint.CHAT, chat(1)) is None
    assert prompt.of(Endpoint.COMPLETIONS, {"prompt": "the fox"}) is not None


def test_the_template_file_wins_over_the_config(tmp_path: Path) -> None:
    where = folder(tmp_path)
    (where / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    prompt = PromptTokens.load(str(where))
    assert prompt.of(Endpoint.CHAT, {"messages": [{"role": "user", "content": "the"}]}) == (
        trained().encode("the", add_special_tokens=False).ids
    )


class Unsplittable:
    """A tokenizer whose ids of a text are not its pieces' ids (as a Metaspace "first" one can be)."""

    def __init__(self) -> None:
        self.inner = trained()

    def get_added_tokens_decoder(self) -> Any:
        return self.inner.get_added_tokens_decoder()

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        found = self.inner.encode(text, add_special_tokens=add_special_tokens)

        class Ids:
            ids = [len(text) % 7, *found.ids]

        return Ids()


def test_a_tokenizer_that_does_not_split_at_added_tokens_turns_the_memo_off() -> None:
    prompt = PromptTokens(Unsplittable(), ChatTemplate(TEMPLATE, {"bos_token": "<|bos|>"}))
    assert not prompt.memo_on  # found when it was loaded
    body = chat(2)
    assert (
        prompt.of(Endpoint.CHAT, body)
        == Unsplittable()
        .encode(ChatTemplate(TEMPLATE, {"bos_token": "<|bos|>"}).render(body) or "", add_special_tokens=False)
        .ids
    )


def test_the_periodic_check_compares_the_whole_prompt(tmp_path: Path) -> None:
    prompt = PromptTokens.load(str(folder(tmp_path)))
    for i in range(CHECK_EVERY + 1):
        prompt.of(Endpoint.COMPLETIONS, {"prompt": corpus(i, 10)})
    assert prompt.memo_on


def test_the_memo_is_bounded_by_characters(tmp_path: Path) -> None:
    prompt = PromptTokens.load(str(folder(tmp_path)), memo_chars=100)
    for i in range(20):
        prompt.of(Endpoint.COMPLETIONS, {"prompt": corpus(i, 8)})
    assert prompt.memo_chars_held() <= 100


def test_a_missing_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer"):
        PromptTokens.load(str(tmp_path))


ENDINGS = ["the", " fox", "  ", "\n\n", "jumps", "12", "345", " é", "héllo", " \t\n x:", "#", "'s", "=1", "中文", ""]


def grown(seed: int, turns: int) -> list[str]:
    """A completions conversation's prompts: each the one before and more, cut anywhere (mid-word, in spaces)."""
    rng = random.Random(seed)
    text, out = corpus(seed, 120), []  # longer than HEAD_CHARS from the first
    for _ in range(turns):
        more = corpus(rng.randrange(1 << 30), rng.randrange(0, 12)) + "".join(rng.sample(ENDINGS, 3))
        text += more[rng.randrange(0, 3) :]
        out.append(text)
    return out


def test_a_grown_completions_prompt_equals_the_whole_encoded_and_encodes_about_its_new_text(tmp_path: Path) -> None:
    prompt = PromptTokens.load(str(folder(tmp_path)))
    whole = trained()
    prompts = grown(3, 12)
    for before, text in zip(["", *prompts], prompts, strict=False):
        encoded = prompt.encoded_chars
        assert prompt.of(Endpoint.COMPLETIONS, {"prompt": text}) == whole.encode(text).ids
        if before:  # the new text and the previous prompt's last two pre-tokens, not the whole prompt
            assert prompt.encoded_chars - encoded < len(text) - len(before) + 40
    assert prompt.extended == len(prompts) - 1
    assert prompt.memo_on and prompt.extends_on


@pytest.mark.parametrize("seed", range(30))
def test_extensions_cut_anywhere_equal_the_whole_encoded(tmp_path: Path, seed: int) -> None:
    prompt = PromptTokens.load(str(folder(tmp_path)))
    whole = trained()
    for text in grown(seed, 8):
        assert prompt.of(Endpoint.COMPLETIONS, {"prompt": text, "add_special_tokens": False}) == (
            whole.encode(text, add_special_tokens=False).ids
        )
    assert prompt.extended == 7


def test_sessions_sharing_an_opening_each_extend_their_own(tmp_path: Path) -> None:
    prompt = PromptTokens.load(str(folder(tmp_path)))
    whole = trained()
    opening = corpus(99, 80)
    sessions = [[opening + p for p in grown(seed, 4)] for seed in range(5)]
    for turn in range(4):
        for session in sessions:
            assert prompt.of(Endpoint.COMPLETIONS, {"prompt": session[turn]}) == whole.encode(session[turn]).ids
    assert prompt.extended == 5 * 3


def test_a_pre_tokenizer_that_adds_a_prefix_space_still_gives_the_whole_ids(tmp_path: Path) -> None:
    """Encoding from a pre-token's start adds a space unless it starts with one: the resume point's check finds
    it (only pre-tokens starting with a space are resumed from)."""
    spaced = trained()
    spaced.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    spaced.save(str(tmp_path / "tokenizer.json"))
    prompt = PromptTokens.load(str(tmp_path / "tokenizer.json"))
    for text in grown(5, 5):
        assert prompt.of(Endpoint.COMPLETIONS, {"prompt": text}) == spaced.encode(text).ids
