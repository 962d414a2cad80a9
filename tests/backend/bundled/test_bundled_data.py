"""The synthetic data recipe: seeded, well-formed, and shaped the way the model card says."""

from __future__ import annotations

import re

from backend.bundled import chat
from backend.bundled.data import BOS, EOS, MIX, Recipe, decode

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


def test_junk_example_ends_its_context_with_an_unweighted_junk_token() -> None:
    recipe = Recipe(3)
    for _ in range(20):
        ex = recipe.example("junk", 400)
        junk_at = ex.weights.index(0.0) + 1  # the one target nobody should learn to predict
        junk = ex.ids[junk_at]
        before = ex.ids[junk_at - 1]
        assert junk in (ord("<"), BOS, EOS, 258, 0)
        assert not (junk == ord("<") and before == ord("\n"))
        answer = decode(ex.ids[junk_at + 1 :])
        assert answer == "" or (MARKER.fullmatch(answer) and answer in decode(ex.ids[:junk_at]))


def test_example_repr_hides_the_text() -> None:
    ex = Recipe(4).example("ref", 200)
    assert "CNRY" not in repr(ex)
