"""``canary.evidence.input_echo``: each transformation it detects, and the limits it states."""

from __future__ import annotations

import base64
import random
import unicodedata

import pytest

from canary.evidence import WINDOW, fold, input_echo, strings_of
from canary.markers import MarkerCodec, MarkerKeyring

CODEC = MarkerCodec(MarkerKeyring({1: b"evidence-test-key-0123456789abcdef"}, current=1))
MARKER = CODEC.issue("acme", nonce=bytes(range(8))).text  # fixed: the limit test is exact
BODY = MARKER[5:]


def chat(*contents: str, **extra: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": c} for c in contents], **extra}


def tool_with_parameter(name: str) -> dict[str, object]:
    parameters = {"type": "object", "properties": {name: {"type": "string"}}}
    return {
        **chat("call the tool"),
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
    }


def schema_with_property(name: str) -> dict[str, object]:
    schema = {"type": "object", "properties": {name: {"type": "string"}}}  # no "required"
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize(
    ("form", "body"),
    [
        ("plain", chat(f"say {MARKER}")),
        ("plain", chat("hi", user=f"id-{BODY}")),  # any field: ``user``, not read for markers
        ("plain", chat(f"only the tag: {BODY[:8]}")),  # a part of 8 characters counts
        ("plain", chat(f"a middle part: {BODY[10:18]}")),
        ("folded", chat(MARKER.lower())),
        ("folded", chat(" ".join(MARKER))),  # spaced
        ("folded", chat("-".join(BODY[i : i + 4] for i in range(0, 32, 4)))),  # grouped
        ("folded", chat("\u200b".join(BODY))),  # zero-width spaces
        ("folded", chat("".join(chr(0xFF00 + ord(c) - 0x20) for c in BODY))),  # full-width
        ("plain", chat(BODY[:5], BODY[5:10], BODY[10:15], BODY[15:])),  # split over messages
        ("folded", chat(BODY[:5].lower(), BODY[5:].lower())),
        ("reversed", chat(MARKER[::-1])),
        ("reversed", chat(" ".join(MARKER[::-1]).lower())),
        ("base64", chat(base64.b64encode(MARKER.encode()).decode())),
        ("base64", chat(base64.urlsafe_b64encode(MARKER.encode()).decode().rstrip("="))),
        ("base64+reversed", chat(base64.b64encode(MARKER[::-1].encode()).decode())),
        ("hex", chat(MARKER.encode().hex())),
        ("folded", chat("".join(c + "\u0301" for c in MARKER))),  # a combining mark after each
        ("folded", chat("".join(c + "\u0308" for c in MARKER.lower()))),
        ("folded", chat("".join(unicodedata.normalize("NFC", c + "\u0301") for c in MARKER))),
        # Only in a key: a tool's parameter name, a response schema's property name. A model
        # that names the parameter, or grammar-constrained output, writes the key verbatim.
        ("plain", tool_with_parameter(MARKER)),
        ("plain", chat("hi", response_format=schema_with_property(MARKER))),
        ("folded", tool_with_parameter(MARKER.lower())),
        ("plain", chat("hi", metadata={BODY[:16]: "x", BODY[16:]: "y"})),  # split over keys
    ],
)
def test_each_detected_form(form: str, body: dict[str, object]) -> None:
    assert input_echo(body, BODY) == form


def test_unrelated_input_and_near_misses_hold_nothing() -> None:
    other = CODEC.issue("acme").text[5:]  # another marker of the same tenant: same tag
    assert input_echo(chat("hello", "CNRY-" + "A" * 32), BODY) is None
    assert input_echo(chat(f"{BODY[:7]} and {BODY[20:27]}"), BODY) is None  # 7 < WINDOW
    assert input_echo(chat(other), BODY[8:]) is None  # the shared tag excluded: nothing else
    assert input_echo({"prompt": "x" * 100_000}, BODY) is None


def test_keys_are_read_in_document_order_and_schema_words_left_out() -> None:
    """Every string of the body is read, keys included, each key before its value; the API's own
    words (keys such as ``role`` and ``content``, values such as ``user``) are left out, so a
    marker split over messages is joined back whole."""
    body = {"messages": [{"role": "user", "content": "a"}], "k1": {"k2": ["b", {"k3": "c"}]}}
    assert list(strings_of(body)) == ["a", "k1", "k2", "b", "k3", "c"]
    pieces = [BODY[i : i + WINDOW - 1] for i in range(0, 32, WINDOW - 1)]  # each under WINDOW
    assert input_echo(chat(*pieces), BODY) == "plain"  # no "role"/"content" between them


def test_limits_pieces_shorter_than_a_window_out_of_order_are_not_detected() -> None:
    """The stated limit: pieces under ``WINDOW`` characters, shuffled, are not reassembled."""
    pieces = [BODY[i : i + WINDOW - 1] for i in range(0, 32, WINDOW - 1)][::-1]  # out of order
    assert input_echo(chat(*pieces), BODY) is None
    assert input_echo(chat(" ".join(pieces)), BODY) is None
    assert input_echo(chat(*pieces[::-1]), BODY) == "plain"  # the same pieces in order: found


def test_random_text_does_not_match_by_chance() -> None:
    rng = random.Random(20261001)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 "
    text = "".join(rng.choice(alphabet) for _ in range(200_000))
    assert input_echo(chat(text), BODY) is None
    assert fold(" a-b.c ") == "ABC"
