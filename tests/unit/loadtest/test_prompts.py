import asyncio
import random
from collections.abc import Sequence

from loadtest.prompts import Prompt, WordTokenizer, build_prompt, word_ids


def build(tok: object, n: int, salt: int, index: int) -> Prompt:
    return asyncio.run(build_prompt(tok, n, salt, index, random.Random(salt * 7 + index)))  # type: ignore[arg-type]


def test_word_prompt_has_exact_length() -> None:
    for n in (1, 5, 128, 16384):
        p = build(WordTokenizer(), n, salt=11, index=3)
        assert p.tokens == n
        assert len(word_ids(p.text)) == n


def test_prompts_differ_in_their_first_tokens() -> None:
    texts = [build(WordTokenizer(), 64, salt=5, index=i).text for i in range(50)]
    firsts = {tuple(t.split()[:4]) for t in texts}
    assert len(firsts) == 50
    other_run = build(WordTokenizer(), 64, salt=6, index=0).text
    assert other_run.split()[:4] != texts[0].split()[:4]


class BosPairTokenizer:
    """Adds a BOS, and merges the word pair "1 2" into one token on re-encoding (a drifting round trip)."""

    async def encode(self, text: str, *, special: bool = True) -> list[int]:
        ids: list[int] = []
        words = text.split()
        i = 0
        while i < len(words):
            if words[i : i + 2] == ["1", "2"]:
                ids.append(99_999)
                i += 2
            else:
                ids.append(int(words[i]) + 1 if words[i].isdigit() else 0)
                i += 1
        return ([50_000] if special else []) + ids

    async def decode(self, ids: Sequence[int]) -> str:
        return " ".join("1 2" if i == 99_999 else str(i - 1) for i in ids)


def test_fits_length_with_specials_and_drift() -> None:
    tok = BosPairTokenizer()
    for idx in range(20):
        p = build(tok, 40, salt=1, index=idx)
        assert p.tokens == 40
        assert len(asyncio.run(tok.encode(p.text))) == 40
