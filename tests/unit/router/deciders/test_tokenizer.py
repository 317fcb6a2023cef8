"""The router's tokenizer seam: a HuggingFace tokenizer.json read once, encoding text alone (no special tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from router.deciders.prompt_tokens import PromptTokens
from router.deciders.session_affinity import SessionAffinity
from router.errors import ConfigError
from router.kv_events.index import KvIndex
from router.kv_events.view import KvEventView


def saved(tmp_path: Path) -> Path:
    tokenizer = Tokenizer(models.WordLevel({"<s>": 0, "hello": 1, "world": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_a_model_directory_or_its_file_encodes_without_special_tokens(tmp_path: Path) -> None:
    where = saved(tmp_path)
    assert PromptTokens.load(str(where)).plain("hello world") == [1, 2]
    assert PromptTokens.load(str(where / "tokenizer.json")).plain("world x") == [2, 3]


def test_a_missing_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer"):
        PromptTokens.load(str(tmp_path))


def test_the_decider_loads_it_only_with_kv_events(tmp_path: Path) -> None:
    options = {"tokenizer": str(saved(tmp_path))}
    assert SessionAffinity.from_options(options).tokenize is None
    view = KvEventView(KvIndex(10), lambda worker: [])
    tokenize = SessionAffinity.from_options(options, view).tokenize
    assert tokenize is not None and list(tokenize("hello")) == [1]
