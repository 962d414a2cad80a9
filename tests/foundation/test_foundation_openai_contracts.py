"""The JSON walks of ``contracts.openai`` both servers' request schemas apply."""

from __future__ import annotations

import orjson
import pytest

from contracts.openai import (
    MAX_JSON_DEPTH,
    check_passed_on,
    lone_surrogate,
    parser_checked_text,
)


def _nested(depth: int, inner: bytes = b"") -> object:
    return orjson.loads(b"[" * depth + inner + b"]" * depth)


def test_lone_surrogate_names_the_first_place_holding_one() -> None:
    assert lone_surrogate({"a": ["ok", {"b": "x\ud800"}]}) == "a.1.b"
    assert lone_surrogate({"k\udc80": 1}) == "k\udc80"
    assert lone_surrogate(["\ud800"], "messages") == "messages.0"
    assert lone_surrogate("\ud800") == "body"
    assert lone_surrogate({"a": ["é", {"b": "ü"}]}) is None


def test_walks_take_a_value_nested_as_deep_as_the_parser_allows() -> None:
    """orjson reads 1024 levels: no RecursionError (it was a 500 at the gateway's door)."""
    deep = _nested(1023, b'"\\u00e9"')
    assert lone_surrogate(deep) is None
    with pytest.raises(ValueError, match=f"nested more than {MAX_JSON_DEPTH} levels"):
        check_passed_on(deep)


def test_check_passed_on_bounds_the_depth_and_the_text() -> None:
    check_passed_on(_nested(MAX_JSON_DEPTH))
    check_passed_on({"k": [1, 2.5, None, True, "é"]})
    with pytest.raises(ValueError, match="nested more than"):
        check_passed_on(_nested(MAX_JSON_DEPTH + 1))
    with pytest.raises(ValueError, match="lone surrogate"):
        check_passed_on({"a": [[{"b\ud800": 1}]]})
    with pytest.raises(ValueError, match="lone surrogate"):
        check_passed_on([[["x\udfff"]]])


@pytest.mark.parametrize("inner", [b"", b"1", b'"\\u00e9"', b"{}", b'{"k": []}'])
def test_a_parser_checked_body_is_held_to_the_same_depth(inner: bytes) -> None:
    """Within ``parser_checked_text`` (orjson parsed it) only the depth is checked, by another
    walk: the bound is the same, whatever the innermost value."""
    for depth in (MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH):
        value = {"a": [1, "x", _nested(depth, inner)]}
        outcomes = []
        for checked in (False, True):
            try:
                if checked:
                    with parser_checked_text():
                        check_passed_on(value)
                else:
                    check_passed_on(value)
                outcomes.append("ok")
            except ValueError as exc:
                outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1], (depth, inner, outcomes)
    with parser_checked_text():
        check_passed_on({"x\ud800": "not looked at"})
    with pytest.raises(ValueError, match="lone surrogate"):
        check_passed_on({"x\ud800": "looked at again"})
