"""The tiny model built for real (torch, transformers, tokenizers): deterministic, servable shape, chat template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from stack.tiny_model import BOS, SIZES, build, is_built
from tests.integration.support import INTEGRATION

pytestmark = INTEGRATION


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_two_builds_are_byte_identical_and_shaped_as_asked(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build(tmp_path / "tiny", "tiny")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(again / name) == digest(tiny_model_dir / name), name
    config = json.loads((again / "config.json").read_text())
    shape = SIZES["tiny"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (
        shape.layers,
        shape.hidden,
        shape.kv_heads,
    )
    assert config["max_position_embeddings"] == 4096
    assert is_built(again, "tiny")
    assert not is_built(again, "bench")


def test_tokenizer_encodes_every_byte_and_renders_the_chat_template(tiny_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "déf f(x):\n\treturn x  # ✓"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids(BOS)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
