"""The JSON walks of ``contracts.openai`` both servers' request schemas apply."""

from __future__ import annotations

import orjson
import pytest

from contracts.openai import MAX_JSON_DEPTH, check_passed_on, lone_surrogate


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
