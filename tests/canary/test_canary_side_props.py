"""Every byte the model writes outside the text, under random split points and interleavings:
tool-call arguments (streamed the way vLLM streams them), refusal text, logprobs tokens and each
rank of ``top_logprobs`` (chat's lists, and the completions API's {token: logprob} maps), in one of
two choices (or two tool calls) whose events interleave.

A foreign marker split anywhere across such deltas is cut like one in the text, and the client
gets nothing of it (these fields are rewritten, so the guard's holdback never goes out; the map
keys are sent as written, so at most ``CNRY-`` and 7 characters, never the tag); the
tenant's own marker is stripped, and every stream keeps exactly its own text (nothing is spliced
from one choice or tool call into another). Real parts: ``LeakFirewall`` guards with a real codec
and ledger in the gateway's ``StreamRelay``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from canary.firewall import CanaryCut, LeakFirewall, TagIndex
from canary.injection import MarkerLedger, RequestMarkers
from canary.markers import MarkerCodec, MarkerKeyring
from contracts.plugins import RequestInfo
from gateway.lifecycle import Phase
from gateway.proxy.relay import StreamRelay
from gateway.upstream.base import Endpoint

CODEC = MarkerCodec(MarkerKeyring({1: bytes(range(32))}, current=1))
TENANTS = [f"tn_{i:04d}" for i in range(8)]
OWNER, VICTIM = TENANTS[0], TENANTS[5]
OWN = CODEC.issue(OWNER)
FOREIGN = CODEC.issue(VICTIM)
ID = "chatcmpl-1"
Stream = tuple[int, int]  # (choice index, tool-call index)


def _token(text: str) -> dict[str, Any]:
    return {"token": text, "logprob": -0.5, "bytes": list(text.encode()), "top_logprobs": []}


def _arguments(stream: Stream, piece: str) -> dict[str, Any]:
    call = {"index": stream[1], "function": {"arguments": piece}}
    return {"index": stream[0], "delta": {"tool_calls": [call]}}


def _refusal(stream: Stream, piece: str) -> dict[str, Any]:
    return {"index": stream[0], "delta": {"refusal": piece}}


def _logprob(stream: Stream, piece: str) -> dict[str, Any]:
    return {"index": stream[0], "delta": {}, "logprobs": {"content": [_token(piece)]}}


def _top_logprob(stream: Stream, piece: str) -> dict[str, Any]:
    token = {**_token("x"), "top_logprobs": [_token("x"), _token(piece)]}
    return {"index": stream[0], "delta": {}, "logprobs": {"content": [token]}}


def _token_map(stream: Stream, piece: str) -> dict[str, Any]:
    """The completions API's logprobs: the alternatives as a {token: logprob} map, rank 1 here."""
    logprobs = {"tokens": ["x"], "token_logprobs": [-0.1], "top_logprobs": [{"x": -0.1, piece: -2}]}
    return {"index": stream[0], "text": "x", "logprobs": logprobs}


def _read_token_map(choice: dict[str, Any]) -> list[tuple[Stream, str]]:
    maps = (choice.get("logprobs") or {}).get("top_logprobs") or []
    return [((choice["index"], 0), list(m)[1]) for m in maps if len(m) > 1]


def _read_arguments(choice: dict[str, Any]) -> list[tuple[Stream, str]]:
    return [
        ((choice["index"], call["index"]), call.get("function", {}).get("arguments", ""))
        for call in choice.get("delta", {}).get("tool_calls", [])
    ]


def _read_refusal(choice: dict[str, Any]) -> list[tuple[Stream, str]]:
    return [((choice["index"], 0), choice.get("delta", {}).get("refusal") or "")]


def _read_logprob(choice: dict[str, Any]) -> list[tuple[Stream, str]]:
    content = (choice.get("logprobs") or {}).get("content") or []
    return [((choice["index"], 0), t["token"]) for t in content]


def _read_top_logprob(choice: dict[str, Any]) -> list[tuple[Stream, str]]:
    content = (choice.get("logprobs") or {}).get("content") or []
    return [((choice["index"], 0), t["top_logprobs"][1]["token"]) for t in content]


Make = Callable[[Stream, str], dict[str, Any]]
Read = Callable[[dict[str, Any]], list[tuple[Stream, str]]]
KINDS: dict[str, tuple[Make, Read]] = {
    "tool-call arguments": (_arguments, _read_arguments),
    "refusal": (_refusal, _read_refusal),
    "logprobs tokens": (_logprob, _read_logprob),
    "a top_logprobs rank": (_top_logprob, _read_top_logprob),
    "a completions top_logprobs rank (map keys)": (_token_map, _read_token_map),
}
CUT_ONLY = {"a completions top_logprobs rank (map keys)"}  # sent as the engine wrote them


def _header(stream: Stream) -> dict[str, Any]:
    """vLLM's first delta of a tool call: id, type and name, empty arguments."""
    call = {
        "index": stream[1],
        "id": f"chatcmpl-tool-{stream[0]}{stream[1]}",
        "type": "function",
        "function": {"name": "lookup", "arguments": ""},
    }
    return {"index": stream[0], "delta": {"role": "assistant", "tool_calls": [call]}}


@st.composite
def pieces(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(1, len(text) - 1), max_size=len(text) // 2)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@st.composite
def interleaved(draw: st.DrawFn, first: list[str], second: list[str]) -> list[tuple[int, str]]:
    """The two piece lists merged in a random order that keeps each list's own order."""
    order = draw(st.permutations([0] * len(first) + [1] * len(second)))
    queues = [list(first), list(second)]
    return [(which, queues[which].pop(0)) for which in order]


def _relay(own: frozenset[bytes], endpoint: Endpoint) -> StreamRelay:
    ledger = MarkerLedger()
    ledger.put("r1", RequestMarkers(own=own))
    tags = TagIndex(CODEC)
    tags.replace(TENANTS)
    info = RequestInfo("r1", OWNER, "m", "chat.completions", False, 0.0, engine="e1")
    firewall = LeakFirewall(CODEC, ledger=ledger, tags=tags)
    return StreamRelay(
        endpoint=endpoint,
        open_guard=lambda: firewall.open(info),
        wants_usage=False,
        side_prefilter=None,
    )


def _run(
    kind: str, streams: tuple[Stream, Stream], merged: list[tuple[int, str]], own: frozenset[bytes]
) -> tuple[StreamRelay, Phase | None, dict[Stream, str], bytes]:
    """Feed the events; (relay, how it ended, each stream's delivered text, the raw output)."""
    make, read = KINDS[kind]
    endpoint = Endpoint.COMPLETIONS if "completions" in kind else Endpoint.CHAT
    relay = _relay(own, endpoint)
    chunks = [_header(s) for s in streams] if kind == "tool-call arguments" else []
    chunks += [make(streams[which], piece) for which, piece in merged]
    last = {"text": ""} if endpoint is Endpoint.COMPLETIONS else {"delta": {}}
    chunks += [{"index": i, **last, "finish_reason": "stop"} for i in {s[0] for s in streams}]
    events = [f"data: {json.dumps({'id': ID, 'choices': [c]})}\n\n".encode() for c in chunks]
    out, end = b"", None
    for raw in [*events, b"data: [DONE]\n\n"]:
        step = relay.on_event(raw)
        out += b"".join(step.out)
        if step.end is not None:
            end = step.end
            break
    delivered: dict[Stream, str] = defaultdict(str)
    for block in out.decode().split("\n\n"):
        if block.startswith("data: {") and '"error"' not in block:
            for choice in json.loads(block[6:])["choices"]:
                for stream, text in read(choice):
                    delivered[stream] += text
    return relay, end, delivered, out


TWO_CHOICES, TWO_CALLS = ((0, 0), (1, 0)), ((0, 0), (0, 1))
CASES = st.sampled_from(
    [(kind, TWO_CHOICES) for kind in sorted(KINDS)] + [("tool-call arguments", TWO_CALLS)]
)
REWRITTEN_CASES = st.sampled_from(
    [(kind, TWO_CHOICES) for kind in sorted(set(KINDS) - CUT_ONLY)]
    + [("tool-call arguments", TWO_CALLS)]
)
ARGS_BEFORE, ARGS_AFTER = '{"city": "Oslo", "ref": "', '", "n": 2}'
OTHER = '{"q": "Cats and Cows"}'  # C's: each may start a marker, so its guard holds them back


@settings(max_examples=60, deadline=None)
@given(case=CASES, data=st.data())
def test_a_foreign_marker_split_anywhere_is_cut_and_never_shown(
    case: tuple[str, tuple[Stream, Stream]], data: st.DataObject
) -> None:
    kind, pairs = case
    leaking = ARGS_BEFORE + FOREIGN.text + ARGS_AFTER
    merged = data.draw(interleaved(data.draw(pieces(leaking)), data.draw(pieces(OTHER))))
    relay, end, delivered, out = _run(kind, pairs, merged, frozenset())
    assert end is Phase.CUT and isinstance(relay.cut, CanaryCut)
    assert relay.cut.code == "isolation_violation"
    assert [f.victim_tenant for f in relay.cut.findings] == [VICTIM]
    if kind in CUT_ONLY:  # at most CNRY- and 7 characters, never the tag that names the victim
        assert FOREIGN.text[5:13] not in out.decode()
        assert leaking[: len(ARGS_BEFORE) + 12].startswith(delivered[pairs[0]])
    else:  # rewritten like the text: not even the prefix of the marker went out
        assert FOREIGN.text[:6] not in out.decode()
        assert leaking[: len(ARGS_BEFORE)].startswith(delivered[pairs[0]])
    assert OTHER.startswith(delivered[pairs[1]])


@settings(max_examples=60, deadline=None)
@given(case=REWRITTEN_CASES, data=st.data())
def test_the_own_marker_is_stripped_and_each_stream_keeps_its_own_text(
    case: tuple[str, tuple[Stream, Stream]], data: st.DataObject
) -> None:
    kind, pairs = case
    with_own = ARGS_BEFORE + OWN.text + ARGS_AFTER
    merged = data.draw(interleaved(data.draw(pieces(with_own)), data.draw(pieces(OTHER))))
    relay, end, delivered, out = _run(kind, pairs, merged, frozenset({OWN.nonce}))
    assert end is Phase.COMPLETED and relay.cut is None
    assert dict(delivered) == {pairs[0]: ARGS_BEFORE + ARGS_AFTER, pairs[1]: OTHER}
    assert b"CNRY" not in out
