"""The model's tokenizer in the router, for one thing only: checking an answer another replica relayed (the
session-affinity decider's `tokenizer` option). The seam is a function from text to token ids.

The file is read once, when the decider is built: a HuggingFace `tokenizer.json` (the model directory holding it,
or the file). Encoded as the engines' `/tokenize` does for an answer check: the text alone, no special tokens.
The `tokenizers` package is imported here only (the engines' venv has it; a router without the option never
loads it). Measured on the bench model, a relayed answer of 100-560 characters encodes in 90-175 µs on the loaded
2-core box: the decider calls it for a bypass candidate whose previous answer it did not relay, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from router.errors import ConfigError

Tokenize = Callable[[str], Sequence[int]]


def load_tokenizer(where: str) -> Tokenize:
    """The encoder of the `tokenizer.json` at `where` (a file, or a directory holding one)."""
    path = Path(where)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        from tokenizers import Tokenizer
    except ImportError as error:
        raise ConfigError(f"decider option tokenizer: the tokenizers package is not installed ({error})") from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001 - the library raises bare Exception for a missing or unreadable file
        raise ConfigError(f"decider option tokenizer: cannot load {path}: {error}") from None

    def encode(text: str) -> Sequence[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    return encode
