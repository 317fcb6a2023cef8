"""The live replicas check's tally (pure): later turns decode-only, per pass and per replica."""

from loadtest.micro.replicas_live import PASS_WORD, LiveTurn, summary


def test_the_tally_counts_later_turns_per_replica_and_first_turns_apart() -> None:
    turns = [
        LiveTurn(0, 1, 1, "push", 400, 0),
        LiveTurn(0, 2, 0, "bypass", 460, 384),
        LiveTurn(0, 3, 1, "bypass", 520, 512),
        LiveTurn(1, 1, 0, "bypass", 400, 384),
        LiveTurn(1, 2, 1, "push", 700, 0),
    ]
    assert summary(turns, 2) == {
        "later_bypassed": 2,
        "later": 3,
        "first_bypassed": 1,
        "replica0": "1 of 1",
        "replica1": "1 of 2",
    }


def test_both_passes_name_their_prompts_with_one_word_of_the_same_kind() -> None:
    assert set(PASS_WORD) == {"alternate", "one"} and len(set(PASS_WORD.values())) == 2
