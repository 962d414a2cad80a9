"""The tenant's own marker is stripped from every field the model writes, not only the text:
reasoning, refusal, tool-call arguments and logprobs tokens (with their bytes), streaming (split
across deltas at many offsets) and not. Identifiers are never rewritten, a foreign marker in those
fields still cuts, and text a field's guard held back at the end is delivered, not lost.

Real parts throughout: ``LeakFirewall`` guards with a real codec and ledger in the gateway's
``StreamRelay`` / ``relay_body`` (the same path as ``test_canary_firewall``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest
from openai_contract import check_sse

from canary.firewall import CanaryCut, LeakFirewall, TagIndex
from canary.injection import MarkerLedger, RequestMarkers
from canary.markers import MarkerCodec, MarkerKeyring
from contracts.plugins import RequestInfo
from contracts.sse import SseSplitter
from gateway.proxy.body import relay_body
from gateway.proxy.relay import StreamRelay
from gateway.upstream.base import Endpoint

CODEC = MarkerCodec(MarkerKeyring({1: bytes(range(32))}, current=1))
TENANTS = [f"tn_{i:04d}" for i in range(8)]
OWNER = TENANTS[0]
OWN = CODEC.issue(OWNER)
TEXT = f"Thinking: the code is {OWN.text}. Done."
STRIPPED = "Thinking: the code is . Done."
ID = "chatcmpl-CNC"  # an id with C's: held back and shifted if it were ever rewritten


def _guards(endpoint: Endpoint = Endpoint.CHAT) -> tuple[LeakFirewall, RequestInfo]:
    ledger = MarkerLedger()
    ledger.put("r1", RequestMarkers(own=frozenset({OWN.nonce})))
    tags = TagIndex(CODEC)
    tags.replace(TENANTS)
    info = RequestInfo("r1", OWNER, "m", endpoint.value, False, 0.0, engine="e1")
    return LeakFirewall(CODEC, ledger=ledger, tags=tags), info


def _split(text: str, step: int, offset: int) -> list[str]:
    cuts = [0, *range(offset, len(text), step), len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def _sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def _stream(
    chunks: list[dict[str, Any]], endpoint: Endpoint = Endpoint.CHAT
) -> tuple[list[dict[str, Any]], Any, bytes]:
    """(client's JSON events, cut, raw output) for upstream chunks through the firewall relay."""
    fw, info = _guards(endpoint)
    relay = StreamRelay(
        endpoint=endpoint,
        open_guard=lambda: fw.open(info),
        wants_usage=False,
        side_prefilter=None,
    )
    out = b""
    for event in SseSplitter().feed(_sse(chunks)):
        step = relay.on_event(event)
        out += b"".join(step.out)
        if step.end is not None:
            break
    events = [
        json.loads(block[6:]) for block in out.decode().split("\n\n") if block.startswith("data: {")
    ]
    return events, relay.cut, out


def _delta_chunks(field: str, pieces: list[str]) -> list[dict[str, Any]]:
    chunks = [{"id": ID, "choices": [{"index": 0, "delta": {field: p}}]} for p in pieces]
    chunks.append({"id": ID, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return chunks


def _joined(events: list[dict[str, Any]], field: str) -> str:
    return "".join(
        c.get("delta", {}).get(field) or "" for e in events for c in e.get("choices", [])
    )


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "refusal", "content"])
@pytest.mark.parametrize(("step", "offset"), [(1, 1), (3, 2), (5, 24), (7, 30), (64, 64)])
def test_streamed_text_fields_lose_the_own_marker(field: str, step: int, offset: int) -> None:
    events, cut, out = _stream(_delta_chunks(field, _split(TEXT, step, offset)))
    assert cut is None
    assert _joined(events, field) == STRIPPED
    assert b"CNRY" not in out and OWN.text[5:20].encode() not in out
    assert {e["id"] for e in events} == {ID}


def test_streamed_tool_call_arguments_lose_the_own_marker() -> None:
    args = json.dumps({"query": f"look up {OWN.text} please"})
    chunks = [
        {
            "id": ID,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_C1" if n == 0 else None,
                                "type": "function",
                                "function": {"name": "Search" if n == 0 else None, "arguments": p},
                            }
                        ]
                    },
                }
            ],
        }
        for n, p in enumerate(_split(args, 4, 3))
    ]
    events, cut, out = _stream(chunks)
    assert cut is None and b"CNRY" not in out
    calls = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls", [])]
    assert "".join(tc["function"]["arguments"] for tc in calls) == args.replace(OWN.text, "")
    assert calls[0]["id"] == "call_C1" and calls[0]["function"]["name"] == "Search"
    assert {tc["index"] for tc in calls} == {0}


def _logprob(token: str) -> dict[str, Any]:
    top = [{"token": token, "logprob": -0.1, "bytes": list(token.encode())}]
    return {"token": token, "logprob": -0.1, "bytes": list(token.encode()), "top_logprobs": top}


def test_streamed_logprobs_tokens_and_their_bytes_lose_the_own_marker() -> None:
    chunks = [
        {
            "id": ID,
            "choices": [
                {"index": 0, "delta": {"content": ch}, "logprobs": {"content": [_logprob(ch)]}}
            ],
        }
        for ch in TEXT  # one token per character, as the byte tokenizer gives them
    ]
    events, cut, out = _stream(chunks)
    assert cut is None and b"CNRY" not in out
    items = [
        i
        for e in events
        for c in e["choices"]
        for i in (c.get("logprobs") or {}).get("content", [])
    ]
    assert "".join(i["token"] for i in items) == STRIPPED
    assert bytes(b for i in items for b in i["bytes"]).decode() == STRIPPED
    assert "".join(t["token"] for i in items for t in i["top_logprobs"]) == STRIPPED
    assert all(i["bytes"] == list(i["token"].encode()) for i in items)
    assert list(OWN.text[5:12].encode()) not in [i["bytes"] for i in items]


def test_text_held_back_at_the_end_of_a_side_field_is_delivered() -> None:
    """A field that ends with what could start a marker: held to the end, then sent, not lost."""
    text = "ends with a C"  # "C" is held back: it could start CNRY-
    events, cut, out = _stream(_delta_chunks("reasoning_content", list(text)))
    assert cut is None
    assert _joined(events, "reasoning_content") == text
    assert out.endswith(b"data: [DONE]\n\n")
    tail = events[-1]
    assert tail["id"] == ID and tail["choices"] == [
        {"index": 0, "delta": {"reasoning_content": "C"}, "finish_reason": None}
    ]


def test_a_foreign_marker_in_reasoning_still_cuts() -> None:
    victim = CODEC.issue(TENANTS[3])
    events, cut, out = _stream(_delta_chunks("reasoning_content", _split(victim.text, 4, 2)))
    assert isinstance(cut, CanaryCut) and cut.code == "isolation_violation"
    assert victim.text[:13].encode() not in out


def test_identifiers_are_screened_but_never_rewritten() -> None:
    chunks = _delta_chunks("content", ["a", "b"])
    for chunk in chunks:
        chunk["model"] = "CNRY-lookalike-C"
    events, cut, _ = _stream(chunks)
    assert cut is None
    assert [(e["id"], e["model"]) for e in events] == [(ID, "CNRY-lookalike-C")] * len(events)


def test_non_streaming_side_fields_lose_the_own_marker() -> None:
    fw, info = _guards()
    tokens = [_logprob(ch) for ch in TEXT]
    body = {
        "id": ID,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": TEXT,
                    "reasoning_content": TEXT,
                    "refusal": TEXT,
                    "tool_calls": [
                        {
                            "id": "call_C1",
                            "type": "function",
                            "function": {"name": "f", "arguments": json.dumps({"q": TEXT})},
                        }
                    ],
                },
                "logprobs": {"content": tokens},
            }
        ],
    }
    out = relay_body(Endpoint.CHAT, body, lambda: fw.open(info))
    assert isinstance(out, dict) and OWN.text not in json.dumps(out)
    message = out["choices"][0]["message"]
    assert [message[k] for k in ("content", "reasoning_content", "refusal")] == [STRIPPED] * 3
    assert message["tool_calls"][0]["function"]["arguments"] == json.dumps({"q": STRIPPED})
    assert message["tool_calls"][0]["id"] == "call_C1"
    items = out["choices"][0]["logprobs"]["content"]
    assert "".join(i["token"] for i in items) == STRIPPED
    assert bytes(b for i in items for b in i["bytes"]).decode() == STRIPPED
    assert body["choices"][0]["message"]["reasoning_content"] == TEXT  # the input is not mutated


def test_non_streaming_completions_logprobs_tokens_and_tails() -> None:
    fw, info = _guards(Endpoint.COMPLETIONS)
    text = TEXT + " C"  # ends with a held-back "C", which must come back at the end
    body = {
        "id": ID,
        "choices": [{"index": 0, "text": text, "logprobs": {"tokens": list(text)}}],
    }
    out = relay_body(Endpoint.COMPLETIONS, body, lambda: fw.open(info))
    assert isinstance(out, dict)
    assert out["choices"][0]["text"] == STRIPPED + " C"
    assert "".join(out["choices"][0]["logprobs"]["tokens"]) == STRIPPED + " C"


def test_every_choice_and_tool_call_keeps_its_own_tail() -> None:
    chunks: list[dict[str, Any]] = []
    for n in range(2):
        call = {"index": n, "function": {"arguments": f"x{n} C"}}
        chunks.append({"id": ID, "choices": [{"index": n, "delta": {"tool_calls": [call]}}]})
    events, cut, _ = _stream(chunks)
    assert cut is None
    got: dict[tuple[int, int], str] = defaultdict(str)
    for e in events:
        for c in e["choices"]:
            for tc in c.get("delta", {}).get("tool_calls", []):
                got[(c["index"], tc["index"])] += tc["function"]["arguments"]
    # One guard per choice and tool call: each keeps its own held-back "C" to the end.
    assert got == {(0, 0): "x0 C", (1, 1): "x1 C"}


def test_a_field_name_spelled_with_escapes_is_still_rewritten() -> None:
    fw, info = _guards()
    relay = StreamRelay(
        endpoint=Endpoint.CHAT,
        open_guard=lambda: fw.open(info),
        wants_usage=False,
        side_prefilter=None,
    )
    out = b""
    for piece in _split(TEXT, 6, 4):
        data = json.dumps({"id": ID, "choices": [{"index": 0, "delta": {"reasoning": piece}}]})
        data = data.replace('"reasoning"', '"\\u0072easoning"')
        out += b"".join(relay.on_event(f"data: {data}\n\n".encode()).out)
    out += b"".join(relay.on_event(b"data: [DONE]\n\n").out)
    assert b"CNRY" not in out
    events = [json.loads(b[6:]) for b in out.decode().split("\n\n") if b.startswith("data: {")]
    assert _joined(events, "reasoning") == STRIPPED


HEAD = {"id": ID, "object": "chat.completion.chunk", "created": 1, "model": "m"}
COMPLETION_HEAD = {**HEAD, "object": "text_completion"}


def _chat_chunk(choice: dict[str, Any]) -> dict[str, Any]:
    return {**HEAD, "choices": [{"index": 0, "finish_reason": None, **choice}]}


def _held_tails() -> dict[str, list[dict[str, Any]]]:
    """Schema-valid upstream streams whose side fields end with a held-back "C"."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    tool_calls = [
        _chat_chunk({"delta": {"role": "assistant", "tool_calls": [call]}}),
        *(
            _chat_chunk({"delta": {"tool_calls": [{"index": 0, "function": {"arguments": p}}]}})
            for p in ['{"a": ', '"x C']
        ),
    ]
    refusal = [_chat_chunk({"delta": {"refusal": p}}) for p in ("no ", "C")]
    tokens = [
        _chat_chunk(
            {"delta": {"content": ch}, "logprobs": {"content": [_logprob(ch)], "refusal": None}}
        )
        for ch in "a C"
    ]
    ranked = [
        _chat_chunk(
            {
                "delta": {"content": ch},
                "logprobs": {
                    "content": [{**_logprob(ch), "top_logprobs": [_logprob(ch), _logprob(alt)]}],
                    "refusal": None,
                },
            }
        )
        for ch, alt in zip("ab", "xC", strict=True)
    ]
    return {"tool call": tool_calls, "refusal": refusal, "logprobs": tokens, "top rank": ranked}


@pytest.mark.parametrize("kind", ["tool call", "refusal", "logprobs", "top rank"])
@pytest.mark.parametrize("finished", [False, True])
def test_a_held_back_tail_goes_out_as_a_schema_valid_chunk(kind: str, finished: bool) -> None:
    """The chunk carrying what a side field's guard held to the end is a valid
    ``chat.completion.chunk``: a choice with its ``delta`` and ``finish_reason``, a logprobs
    object with ``content`` and ``refusal``, token entries with ``logprob``, ``bytes`` and
    ``top_logprobs`` (the tail is no sampled token: logprob 0 adds nothing to a sum)."""
    chunks = _held_tails()[kind]
    if finished:
        chunks.append(_chat_chunk({"delta": {}, "finish_reason": "stop"}))
    events, cut, out = _stream(chunks)
    assert cut is None and out.endswith(b"data: [DONE]\n\n")
    check_sse(out, "CreateChatCompletionStreamResponse")
    tail = events[-1]["choices"][0]
    assert tail["index"] == 0 and "C" in json.dumps(tail)
    for item in (tail.get("logprobs") or {}).get("content") or []:
        assert item["bytes"] == list(item["token"].encode())


def test_completions_tails_are_schema_valid_chunks() -> None:
    """A held-back "C" at the end of a completion's text and of its logprobs tokens."""
    chunks = [
        {
            **COMPLETION_HEAD,
            "choices": [
                {
                    "index": 0,
                    "text": ch,
                    "finish_reason": None,
                    "logprobs": {"tokens": [ch], "token_logprobs": [-0.5], "top_logprobs": [{}]},
                }
            ],
        }
        for ch in "a C"
    ]
    events, cut, out = _stream(chunks, Endpoint.COMPLETIONS)
    assert cut is None
    check_sse(out, "CreateCompletionChunk")
    assert "".join(c["text"] for e in events for c in e["choices"]) == "a C"
    tokens = [
        t for e in events for c in e["choices"] for t in (c["logprobs"] or {}).get("tokens", [])
    ]
    assert "".join(tokens) == "a C"


def test_an_event_whose_text_is_all_held_back_still_delivers_its_other_fields() -> None:
    """A chunk whose whole text the guard holds back (a possible marker start) used to be dropped
    with everything else it carried: the role, a tool call's id and name, the logprobs of its
    tokens. They go out with an empty text; the held text follows when it is decided."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    other_token = {"content": [_logprob("<0x43>")], "refusal": None}  # a byte token's own name
    chunks = [
        _chat_chunk({"delta": {"role": "assistant", "content": "C"}}),
        _chat_chunk({"delta": {"content": "N", "tool_calls": [call]}}),
        _chat_chunk({"delta": {"content": "R"}, "logprobs": other_token}),
        _chat_chunk({"delta": {"content": "Y"}, "finish_reason": "stop"}),
    ]
    events, cut, out = _stream(chunks)
    assert cut is None
    check_sse(out, "CreateChatCompletionStreamResponse")
    choices = [c for e in events for c in e["choices"]]
    assert choices[0]["delta"]["role"] == "assistant"
    assert [c["delta"]["tool_calls"] for c in choices if "tool_calls" in c["delta"]] == [[call]]
    logprobs = [c["logprobs"] for c in choices if c.get("logprobs")]
    assert logprobs == [other_token]
    assert _joined(events, "content") == "CNRY"  # not a marker: delivered at the finish
    assert [c["finish_reason"] for c in choices][-1] == "stop"


def test_a_tail_of_top_logprobs_ranks_keeps_each_rank_in_one_token_entry() -> None:
    """The ranks' tails used to come out as entries of their own, rank 1's at rank 0: the tail
    chunk now has one token entry whose ``top_logprobs`` hold each rank's tail at its rank, each
    a proper entry (token, logprob, bytes)."""

    def entry(token: str, alternatives: list[str]) -> dict[str, Any]:
        plain = [{"token": a, "logprob": -1.0, "bytes": list(a.encode())} for a in alternatives]
        return {**_logprob(token), "top_logprobs": plain}

    chunks = [
        _chat_chunk(
            {
                "delta": {"content": ch},
                "logprobs": {"content": [entry(ch, [r0, r1])], "refusal": None},
            }
        )
        for ch, r0, r1 in [("a", "a", "x"), ("b", "b", "y"), ("C", "C", "CN")]
    ]
    events, cut, out = _stream(chunks)
    assert cut is None
    check_sse(out, "CreateChatCompletionStreamResponse")
    tail = events[-1]["choices"][0]["logprobs"]["content"]
    assert len(tail) == 1, tail
    assert tail[0]["token"] == "C" and tail[0]["bytes"] == [67]
    ranks = tail[0]["top_logprobs"]
    assert [r["token"] for r in ranks] == ["C", "CN"], ranks
    for ranked in ranks:
        assert set(ranked) == {"token", "logprob", "bytes"}
        assert ranked["bytes"] == list(ranked["token"].encode())
