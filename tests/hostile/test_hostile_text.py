"""Text no engine can use, sent to the gateway and straight to the engine.

Attacker: a client that reaches an engine directly (anything on its network, or a tenant the
gateway forwards for) or the gateway, with text JSON can carry but Unicode cannot: a lone UTF-16
surrogate escaped as ``\\ud800`` in any string field (the union-typed ones -- chat ``content``,
``stop``, content parts -- let one past validation into the tokenizer: a 500), and a stop
sequence of 6 MB, which the gateway forwarded until the engine's body limit answered 413.

Proves, over real HTTP against a real ``kvguard backend unified`` process and the gateway in front
of it: every such field is a 400 with an OpenAI-style body naming the field; the stop string is
refused by the gateway itself with a 400 naming ``stop`` (and by the engine the same way), and
the longest allowed stop sequence still works.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hostile_harness import ENGINE_MODEL, ServedGateway, openai_error

from contracts.openai import MAX_STOP_CHARS
from kvguard.testing import EngineProcess

MB = 1_000_000
SURROGATE = "\ud800"


def _post_raw(url: str, body: dict[str, object], headers: dict[str, str] | None = None):
    """POST ``body`` as ASCII JSON (a lone surrogate goes as its escape, as attackers send it)."""
    raw = json.dumps(body).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(url, content=raw, headers=all_headers, timeout=60)


def _cases() -> dict[str, tuple[str, dict[str, object], str]]:
    """name -> (path, body, the param the 400 must name)."""
    user = [{"role": "user", "content": "hi"}]
    return {
        "prompt": ("/v1/completions", {"prompt": "a" + SURROGATE}, "prompt"),
        "chat-content": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a" + SURROGATE}]},
            "messages.0.content",
        ),
        "content-part": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
            "messages.0.content.0.text",
        ),
        "stop": ("/v1/chat/completions", {"messages": user, "stop": [SURROGATE]}, "stop.0"),
        "name": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "name": SURROGATE}]},
            "messages.0.name",
        ),
        "tokenize": ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_a_lone_surrogate_sent_to_the_engine_is_a_400(engine: EngineProcess, case: str) -> None:
    path, body, param = _cases()[case]
    r = _post_raw(engine.url + path, {"model": ENGINE_MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = openai_error(r)
    assert error["param"] == param and "lone surrogate" in error["message"], error


def test_a_6_mb_stop_string_is_refused_by_the_gateway(gateway: ServedGateway) -> None:
    _, key = gateway.create_tenant("long-stop")
    auth = {"Authorization": f"Bearer {key}"}
    user = [{"role": "user", "content": "hi"}]
    for stop in ("s" * (6 * MB), ["x", "s" * (MAX_STOP_CHARS + 1)]):
        body = {"model": ENGINE_MODEL, "messages": user, "max_tokens": 2, "stop": stop}
        r = _post_raw(gateway.url + "/v1/chat/completions", body, auth)
        assert r.status_code == 400, r.text[:300]
        error = openai_error(r)
        assert error["param"] == "stop" and str(MAX_STOP_CHARS) in error["message"], error
    body = {"model": ENGINE_MODEL, "messages": user, "max_tokens": 2, "stop": "s" * MAX_STOP_CHARS}
    assert _post_raw(gateway.url + "/v1/chat/completions", body, auth).status_code == 200


def test_the_engine_refuses_a_long_stop_string_the_same_way(engine: EngineProcess) -> None:
    body = {"model": ENGINE_MODEL, "prompt": "hi", "max_tokens": 2, "stop": "s" * 5000}
    r = _post_raw(engine.url + "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert openai_error(r)["param"] == "stop"
