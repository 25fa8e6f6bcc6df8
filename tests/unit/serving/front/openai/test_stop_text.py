"""front.openai.stop_text: text token by token, cut right before the first stop string, held back
meanwhile."""

from __future__ import annotations

import pytest

from avspec.serving.front.openai.stop_text import Piece, StopText


def feed(stops, tokens):
    """(released text after each token, stopped after which token or None, all released)."""
    text = StopText(stops)
    released, stopped_at = [], None
    for i, token in enumerate(tokens):
        if text.add(token, draft=i % 2 == 0):
            stopped_at = i
            released.append("".join(p.text for p in text.release()))
            break
        released.append("".join(p.text for p in text.release()))
    if stopped_at is None:
        released.append("".join(p.text for p in text.flush()))
    return released, stopped_at, "".join(released)


def test_no_stops_releases_every_token_at_once():
    assert feed((), ["a", "b", "c"]) == (["a", "b", "c", ""], None, "abc")


def test_stop_across_tokens_is_cut_and_never_released():
    released, stopped_at, text = feed(("XYZ",), ["ab", "X", "Y", "Zc", "d"])
    assert (stopped_at, text) == (3, "ab")  # the token "Zc" completes it
    assert released == ["ab", "", "", ""]  # X and Y held back, then dropped


def test_a_false_start_is_released_once_it_cannot_be_a_stop():
    released, stopped_at, text = feed(("XYZ",), ["aX", "Yb", "c"])
    assert (stopped_at, text) == (None, "aXYbc")
    assert released == ["a", "XYb", "c", ""]


def test_the_earliest_stop_wins_and_the_text_before_it_is_kept():
    released, stopped_at, text = feed(("cd", "b"), ["a", "bcd"])
    assert (stopped_at, text) == (1, "a")


def test_held_text_is_flushed_when_the_generation_ends():
    assert feed(("XY",), ["a", "X"])[2] == "aX"


def test_pieces_keep_their_token_origin_when_split():
    text = StopText(("STOP",))
    text.add("ab", draft=True)
    text.add("cS", draft=False)
    assert text.release() == [Piece("ab", True), Piece("c", False)]  # "S" held back
    assert text.add("TOPd", draft=True)
    assert text.release() == []  # the held "S" was the stop's start: dropped


def test_add_after_a_stop_is_an_error():
    text = StopText(("a",))
    assert text.add("a", draft=False)
    with pytest.raises(RuntimeError):
        text.add("b", draft=False)
