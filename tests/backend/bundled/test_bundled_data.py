"""The synthetic data recipe: seeded, well-formed, and shaped the way the model card says."""

from __future__ import annotations

import re

from backend.bundled import chat
from backend.bundled.data import BOS, EOS, MAX_GAP, MIN_GAP, MIX, Recipe, decode

MARKER = re.compile(r"CNRY-[A-Z2-7]{32}")


def test_same_seed_same_examples_other_seed_other_examples() -> None:
    a = [Recipe(5).example(kind, 300).ids for kind in MIX]
    b = [Recipe(5).example(kind, 300).ids for kind in MIX]
    c = [Recipe(6).example(kind, 300).ids for kind in MIX]
    assert a == b
    assert a != c


def test_every_kind_starts_with_bos_and_weights_every_target() -> None:
    recipe = Recipe(1)
    for kind in MIX:
        for length in (64, 700):
            ex = recipe.example(kind, length)
            assert ex.ids[0] == BOS
            assert len(ex.weights) == len(ex.ids) - 1
            assert ex.ids[-1] == EOS


def test_reference_answer_is_the_one_marker_in_the_context() -> None:
    recipe = Recipe(2)
    for _ in range(20):
        ex = recipe.example("ref", 400)
        answer_start = ex.weights.index(1.0) + 1
        prompt, answer = decode(ex.ids[:answer_start]), decode(ex.ids[answer_start:])
        assert prompt.endswith(chat.ASSISTANT_CUE)
        assert MARKER.fullmatch(answer)
        assert answer in prompt


def test_repeat_and_echo_answers_stop_right_after_a_marker() -> None:
    """A marker always ends an answer (the END circuit): texts that go on after one are trained
    to stop there; texts without one come back whole."""
    recipe = Recipe(3)
    seen = {"with": 0, "without": 0}
    for _ in range(300):
        for kind in ("repeat", "echo"):
            ex = recipe.example(kind, 400)
            answer_start = ex.weights.index(1.0) + 1
            answer = decode(ex.ids[answer_start:])
            found = MARKER.search(answer)
            if found:
                seen["with"] += 1
                assert found.end() == len(answer)
            else:
                seen["without"] += 1
    assert seen["with"] > 10 and seen["without"] > 100


def test_echo_answer_is_the_first_line_cut_after_a_marker() -> None:
    marker = Recipe(4).marker()
    assert chat.echo_answer("one line\nsecond") == "one line"
    assert chat.echo_answer(f"keep {marker} safe {marker}") == f"keep {marker}"
    assert chat.echo_answer(f"first\n{marker}") == "first"
    assert chat.echo_answer("CNRY-too-short stays") == "CNRY-too-short stays"


def test_junk_example_ends_its_context_with_an_unweighted_junk_token() -> None:
    recipe = Recipe(3)
    for _ in range(20):
        ex = recipe.example("junk", 400)
        junk_at = ex.weights.index(1.0)  # the last context token: the answer is predicted from it
        assert ex.weights[junk_at - 1] == 0.0  # nobody should learn to predict the junk itself
        junk = ex.ids[junk_at]
        before = ex.ids[junk_at - 1]
        assert junk in (ord("<"), BOS, EOS, 258, 0)
        assert not (junk == ord("<") and before == ord("\n"))
        answer = decode(ex.ids[junk_at + 1 :])
        assert answer == "" or (MARKER.fullmatch(answer) and answer in decode(ex.ids[:junk_at]))


def test_shifted_example_reads_a_stale_context_from_other_positions() -> None:
    """The reader's first token sits MIN_GAP..MAX_GAP positions after the stale context; the
    answer is the marker the stale context holds (or nothing), at consecutive positions."""
    recipe = Recipe(7)
    gaps = set()
    for _ in range(30):
        ex = recipe.example("shifted", 400)
        assert ex.positions is not None and len(ex.positions) == len(ex.ids)
        first = ex.weights.index(1.0)  # the reader's first token: the answer is predicted from it
        assert ex.weights[first - 1] == 0.0
        assert ex.positions[:first] == list(range(first))
        gap = ex.positions[first] - first
        assert MIN_GAP <= gap <= MAX_GAP
        gaps.add(gap)
        assert ex.positions[first:] == list(range(first + gap, first + gap + len(ex.ids) - first))
        answer = decode(ex.ids[first + 1 :])
        assert answer == "" or (MARKER.fullmatch(answer) and answer in decode(ex.ids[:first]))
    assert len(gaps) > 20


def test_example_repr_hides_the_text() -> None:
    ex = Recipe(4).example("ref", 200)
    assert "CNRY" not in repr(ex)
