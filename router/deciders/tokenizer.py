"""The model's tokenizer in the router (the session-affinity decider's `tokenizer` option): read once, when the
decider is built (`read_tokenizer`: a HuggingFace `tokenizer.json`, the model directory holding it or the file),
for the prompt's exact ids (router/deciders/prompt_tokens.py) and for checking an answer another replica relayed.
That check's seam is `Tokenize`, a function from text to token ids (`PromptTokens.plain`: the text alone, no
special tokens, as the engines' `/tokenize` encodes an answer). The `tokenizers` package is imported here only (a
router without the option never loads it). Measured on the bench model, a relayed answer of 100-560 characters
encodes in 90-175 µs on the loaded 2-core box: the decider calls it for a bypass candidate whose previous answer
it did not relay, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from router.errors import ConfigError

Tokenize = Callable[[str], Sequence[int]]


def read_tokenizer(where: str) -> tuple[Any, Path]:
    """The `tokenizers.Tokenizer` of the `tokenizer.json` at `where` (a file, or a directory holding one), and the
    folder it lies in (its config and chat template: router/deciders/prompt_tokens.py)."""
    path = Path(where)
    folder = path if path.is_dir() else path.parent
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        from tokenizers import Tokenizer
    except ImportError as error:
        raise ConfigError(f"decider option tokenizer: the tokenizers package is not installed ({error})") from None
    try:
        return Tokenizer.from_file(str(file)), folder
    except Exception as error:  # noqa: BLE001 - the library raises bare Exception for a missing or unreadable file
        raise ConfigError(f"decider option tokenizer: cannot load {file}: {error}") from None
