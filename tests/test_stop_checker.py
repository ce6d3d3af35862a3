"""StopChecker: stop strings across deltas, held-back partial matches, flush."""

from __future__ import annotations

import random

from worker.engine.stop_checker import StopCheck, StopChecker


def feed(checker: StopChecker, deltas: list[str]) -> tuple[list[str], str | None]:
    out, stop = [], None
    for delta in deltas:
        text, stop = checker.add(delta)
        out.append(text)
        if stop is not None:
            break
    else:
        out.append(checker.flush())
    return out, stop


def test_without_stop_strings_text_passes_through():
    checker = StopChecker(())
    assert checker.add("abc") == ("abc", None) and checker.flush() == ""


def test_stop_string_split_over_deltas_is_trimmed_and_never_shown():
    out, stop = feed(StopChecker(("STOP",)), ["Hello wo", "rld ST", "O", "P and more"])
    assert stop == "STOP"
    assert out == ["Hello wo", "rld ", "", ""]
    assert not any("ST" in piece for piece in out)


def test_include_stop_string_in_output():
    out, stop = feed(StopChecker(("STOP",), include_stop_str_in_output=True), ["Hello ST", "OP tail"])
    assert stop == "STOP" and "".join(out) == "Hello STOP"


def test_false_alarm_is_released():
    out, stop = feed(StopChecker(("STOP",)), ["a ST", "ay", " S"])
    assert stop is None and out == ["a ", "STay", " ", "S"]


def test_held_text_is_flushed_when_ending_otherwise():
    checker = StopChecker(("</end>",))
    assert checker.add("done </e") == ("done ", None)
    assert checker.flush() == "</e"


def test_first_ending_match_wins():
    out, stop = feed(StopChecker(("bc", "abcd")), ["a", "b", "c", "d"])
    assert stop == "bc" and "".join(out) == "a"
    out, stop = feed(StopChecker(("bc", "abcd")), ["xabcd"])  # same answer in one delta
    assert stop == "bc" and "".join(out) == "xa"
    out, stop = feed(StopChecker(("b", "ab")), ["xab"])  # tie on the end: the earlier start
    assert stop == "ab" and "".join(out) == "x"


def test_after_a_match_nothing_more_is_emitted():
    checker = StopChecker(("\n",))
    assert checker.add("line\nrest") == ("line", "\n")
    assert checker.add("more") == ("", "\n") and checker.matched == "\n"


def test_random_chunkings_agree_with_character_by_character():
    rng = random.Random(3)
    alphabet = "abc d\n"
    for _ in range(300):
        stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(3)})
        include = rng.random() < 0.5
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        expected, expected_stop = feed(StopChecker(stops, include), list(text))
        pieces, i = [], 0
        while i < len(text):
            size = rng.randrange(1, 6)
            pieces.append(text[i : i + size])
            i += size
        out, stop = feed(StopChecker(stops, include), pieces)
        assert "".join(out) == "".join(expected) and stop == expected_stop
        final = "".join(out)  # all a client saw: a partial stop string would show here
        if stop is None:
            assert final == text
        else:
            first = min(text.find(s) + len(s) for s in stops if s in text)
            cut = next(text.find(s) for s in sorted(stops, key=lambda s: (text.find(s) + len(s), text.find(s)))
                       if s in text and text.find(s) + len(s) == first)
            assert final == (text[:first] if include else text[:cut])


def test_unarmed_text_is_held_as_armed_text_is_but_never_matches():
    """Before min_tokens (or text another worker already checked) a stop string does not end the
    sequence, while a possible beginning of one is still held back; once armed, only a match that
    ends in new text counts, even one that began in the held text."""
    checker = StopChecker(("END", "ab"))
    assert checker.add("xxENDyyE", armed=False) == StopCheck("xxENDyy", None)  # "E" may begin "END"
    assert checker.add("N", armed=False) == StopCheck("", None)
    assert checker.add("D and more") == StopCheck("", "END")  # began unarmed, ends in armed text

    checker = StopChecker(("ab",))
    assert checker.add("zab", armed=False) == StopCheck("zab", None)
    assert checker.add("c") == StopCheck("c", None)  # the "ab" before was passed over for good
    assert checker.add("a") == StopCheck("", None) and checker.add("b") == StopCheck("", "ab")
