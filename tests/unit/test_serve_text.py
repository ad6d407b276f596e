"""``app.serve.text``: stop strings, incremental detokenization, chat prompts, choice seeds."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from app.serve.text import (
    Detokenizer,
    SimCodec,
    TextStream,
    choice_seed,
    plain_chat_prompt,
    scan_stops,
)


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello", [], ("hello", "", False)),
        ("hello", ["x"], ("hello", "", False)),
        ("hello world", ["wor"], ("hello ", "", True)),
        ("hello wo", ["world"], ("hello ", "wo", False)),  # may still become the stop
        ("hello w", ["world", "wx"], ("hello ", "w", False)),
        ("ab", ["b", "ab"], ("", "", True)),  # the earliest stop wins
        ("abc", ["c", "bc"], ("a", "", True)),
        ("a\n\n", ["\n\n"], ("a", "", True)),
        ("a\n", ["\n\n"], ("a", "\n", False)),
        ("", ["x"], ("", "", False)),
        ("xyz", ["yzq", "zq"], ("x", "yz", False)),  # the longest candidate is held
    ],
)
def test_scan_stops(text: str, stops: list[str], expected: tuple[str, str, bool]) -> None:
    assert scan_stops(text, stops) == expected


def utf8_decode(ids: Sequence[int]) -> str:
    """A byte-level tokenizer: token = byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_incomplete_characters() -> None:
    text = "aé€😀b"
    d = Detokenizer(utf8_decode)
    pieces = [d.add(b) for b in text.encode()]
    assert "".join(pieces) + d.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:2] == ["a", ""]  # the first byte of é gives nothing yet


def test_detokenizer_flushes_an_incomplete_tail_as_replacement() -> None:
    d = Detokenizer(utf8_decode)
    assert d.add(ord("a")) == "a"
    assert d.add(0xE2) == ""
    assert d.flush() == "\ufffd"


def test_detokenizer_with_a_tokenizer_that_merges_spaces() -> None:
    """Decoding depends on neighbours (a SentencePiece-like leading space): the window keeps
    the pieces right."""
    words = {1: "▁hello", 2: "▁world", 3: "!"}

    def decode(ids: Sequence[int]) -> str:
        return "".join(words[i] for i in ids).replace("▁", " ").lstrip(" ")

    d = Detokenizer(decode)
    assert "".join(d.add(t) for t in (1, 2, 3)) + d.flush() == decode([1, 2, 3])


def test_text_stream_cuts_at_a_stop_spanning_tokens() -> None:
    s = TextStream(utf8_decode, ["END"])
    used, text, stopped = s.feed(list(b"abEN"))
    assert (used, text, stopped) == (4, "ab", False)  # "EN" is held
    used, text, stopped = s.feed(list(b"Dzz"))
    assert (used, text, stopped) == (1, "", True)  # D completes it; zz are not used


def test_text_stream_releases_held_text_at_the_end() -> None:
    s = TextStream(utf8_decode, ["END"])
    assert s.feed(list(b"abE")) == (3, "ab", False)
    assert s.finish() == ("E", False)


def test_text_stream_without_stops_streams_everything() -> None:
    s = TextStream(utf8_decode)
    assert s.feed(list("héllo".encode())) == (6, "héllo", False)
    assert s.finish() == ("", False)


def test_streamed_pieces_equal_the_whole_text() -> None:
    data = b"one two\nthree END four"
    whole = TextStream(utf8_decode, ["END"])
    _, all_at_once, _ = whole.feed(list(data))
    piecewise = TextStream(utf8_decode, ["END"])
    out = [piecewise.feed([b])[1] for b in data[:15]]
    assert "".join(out) == all_at_once == "one two\nthree "


def test_plain_chat_prompt() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert plain_chat_prompt(msgs) == "system: be brief\nuser: 2+2?\nassistant:"


def test_sim_codec_one_piece_per_token() -> None:
    codec = SimCodec(32_000, lambda text: [b + 4 for b in text.encode()])
    assert codec.encode("hi", chat=False) == [108, 109]
    assert codec.decode([108, 109, 5000]) == "hi w5000"


def test_choice_seeds_differ_per_choice_and_are_stable() -> None:
    assert choice_seed(None, 0) is None
    seeds = [choice_seed(7, i) for i in range(4)]
    assert len(set(seeds)) == 4 and seeds == [choice_seed(7, i) for i in range(4)]
    assert all(s is not None and 0 <= s < 2**63 for s in seeds)
    assert choice_seed(-3, 0) is not None
