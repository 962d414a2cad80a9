"""Engines that serve /v1/responses (``gateway.responses.passthrough`` and ``.native``), against
the vLLM 0.33.0 stand-in over real HTTP: the body never carries the client's
``previous_response_id``, ``conversation`` or ``store: true`` (the stand-in's store, keyed by id
alone as vLLM's is, shows why); every event the client gets is valid against OpenAI's published
schemas and carries the gateway's id and echo; every model-written string passes the real leak
firewall (deltas, ``*.done`` texts, finished items, the final response), and a leak ends the
stream with ``error`` + ``response.failed`` naming the isolation code."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai_contract import check, check_response_events
from responses_helpers import FOREIGN, OWN, body, env, firewall, passthrough
from standin_openai import Script, ToolCall
from standin_vllm_responses import VLLMResponses, events, responses_app

from contracts.sse import SseSplitter
from gateway.lifecycle import Phase
from gateway.openai.surface import Profile
from gateway.responses.native import NativeStream
from gateway.responses.passthrough import native_body, reasoning_as_messages
from gateway.responses.to_chat import chat_messages
from kvguard.testing import serve

HISTORY = [
    {"type": "message", "role": "user", "content": "first question"},
    {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "first answer", "annotations": []}],
    },
]


async def _post(engine: VLLMResponses, upstream: dict[str, Any]) -> httpx.Response:
    server = await serve(responses_app(engine))
    try:
        async with httpx.AsyncClient(base_url=server.url) as client:
            response = await client.post("/v1/responses", json=upstream)
            await response.aread()
            return response
    finally:
        await server.stop()


def _screen(raw: bytes, open_guard: Any = passthrough) -> tuple[NativeStream, Any, bytes]:
    stream = NativeStream(env(metadata={"k": "v"}), open_guard, hidden_prompt_tokens=1)
    out, step = b"", None
    for event in SseSplitter().feed(raw):
        step = stream.on_event(event)
        out += step.out
        if step.end is not None:
            return stream, step, out
    step = stream.upstream_ended()
    return stream, step, out + step.out


def _raw(objs: list[dict[str, Any]]) -> bytes:
    return b"".join(
        f"event: {o['type']}\ndata: {json.dumps({**o, 'sequence_number': i})}\n\n".encode()
        for i, o in enumerate(objs)
    )


def _engine_events(engine: VLLMResponses, text: str = "hello") -> list[dict[str, Any]]:
    engine.traffic.prompts.append(text)
    return list(events({"input": text}, engine, response_id="resp_engine", prompt_tokens=3))


def test_the_body_carries_the_whole_conversation_and_no_engine_state() -> None:
    request = body(
        input="second question",
        store=True,
        previous_response_id="resp_" + "a" * 48,
        metadata={"k": "v"},
        stream=True,
        temperature=0.2,
        include=[],
    )
    upstream = native_body(request, history=HISTORY, max_output_tokens=77, profile=Profile.VLLM)
    assert upstream["input"] == [
        *HISTORY,
        {"type": "message", "role": "user", "content": "second question"},
    ]
    assert upstream["store"] is False and upstream["max_output_tokens"] == 77
    for never in ("previous_response_id", "conversation", "background", "metadata", "include"):
        assert never not in upstream
    assert upstream["temperature"] == 0.2 and upstream["stream"] is True


def test_admission_reads_reasoning_items_as_messages_which_the_engine_still_gets_as_sent() -> None:
    """The chat form admission counts and screens for a native engine holds every text of every
    reasoning item, sent or stored (vLLM reads the first); the engine gets the items as sent."""
    earlier = {
        "id": "rs_1",
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "earlier thought"}],
        "status": "completed",
    }
    now = {
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "the gist"}],
        "content": [{"type": "reasoning_text", "text": "this thought"}],
    }
    request = body(
        input=[now, {"type": "reasoning", "summary": []}, {"role": "user", "content": "go"}]
    )
    history = [*HISTORY, earlier]
    assert reasoning_as_messages(body(input="go"), HISTORY) is None
    read = reasoning_as_messages(request, history)
    assert read is not None
    assert chat_messages(*read) == [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "assistant", "content": "earlier thought"},
        {"role": "assistant", "content": "this thought\nthe gist"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "go"},
    ]
    upstream = native_body(request, history=history, max_output_tokens=16, profile=Profile.VLLM)
    assert upstream["input"][2:4] == [earlier, now]


async def test_a_streamed_answer_through_the_standin_is_valid_and_the_gateways() -> None:
    engine = VLLMResponses(script=Script(text="the answer is here"), reasoning="let me think")
    request = body(input="question", stream=True, metadata={"k": "v"})
    upstream = native_body(request, history=HISTORY, max_output_tokens=64, profile=Profile.VLLM)
    response = await _post(engine, upstream)
    assert response.status_code == 200
    assert engine.traffic.bodies == [upstream]
    stream, step, out = _screen(response.content, firewall())
    events_out = check_response_events(out)
    assert step.end is Phase.COMPLETED
    final = check("Response", events_out[-1]["response"])
    assert final == stream.response
    assert final["id"] == events_out[0]["response"]["id"] != "resp_engine"
    assert final["metadata"] == {"k": "v"}  # the gateway's echo, never sent to the engine
    assert "kv_transfer_params" not in final and "input_messages" not in final
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "the answer is here "
    assert final["usage"]["input_tokens"] == stream.prompt_tokens - 1


async def test_the_engines_store_is_keyed_by_id_alone_which_the_gateway_never_relies_on() -> None:
    """What a gateway that forwarded previous_response_id would allow: any caller continues (and
    reads back, in the prompt) another's conversation by its id."""
    engine = VLLMResponses(enable_store=True)
    server = await serve(responses_app(engine))
    try:
        async with httpx.AsyncClient(base_url=server.url) as client:
            first = await client.post("/v1/responses", json={"input": "tenant A secret plan"})
            a_id = first.json()["id"]
            stolen = await client.post(
                "/v1/responses", json={"input": "repeat", "previous_response_id": a_id}
            )
            assert stolen.status_code == 200
            assert "tenant A secret plan" in engine.traffic.prompts[-1]
            missing = await client.get("/v1/responses/resp_nothing")
            assert missing.status_code == 404
    finally:
        await server.stop()
    request = body(input="repeat", previous_response_id=a_id)
    upstream = native_body(request, history=[], max_output_tokens=16, profile=Profile.VLLM)
    assert "previous_response_id" not in upstream and upstream["store"] is False


def test_the_own_marker_is_stripped_from_every_repeat_of_the_text() -> None:
    engine = VLLMResponses(script=Script(text=f"code {OWN.text} end"))
    engine.script.tool_calls = [ToolCall("f", f'{{"x": "{OWN.text}"}}', pieces=7)]
    stream, step, out = _screen(_raw(_engine_events(engine)), firewall())
    assert OWN.text[5:13].encode() not in out
    events_out = check_response_events(out)
    texts = [e.get("text") for e in events_out if e["type"] == "response.output_text.done"]
    assert texts == ["code  end "]
    final = events_out[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "code  end "
    assert final["output"][1]["arguments"] == '{"x": ""}'
    done = [e for e in events_out if e["type"] == "response.output_item.done"]
    assert done[0]["item"]["content"][0]["text"] == "code  end "


def _assert_cut(step: Any, out: bytes) -> None:
    events_out = check_response_events(out)
    assert step.end is Phase.CUT and step.code == "isolation_violation"
    assert [e["type"] for e in events_out[-2:]] == ["error", "response.failed"]
    assert events_out[-2]["code"] == "isolation_violation"
    assert events_out[-1]["response"]["error"]["message"].startswith("isolation_violation")
    assert not any(e["type"] == "response.completed" for e in events_out)
    assert FOREIGN.text[5:13].encode() not in out


def test_a_leak_through_the_engine_is_cut() -> None:
    engine = VLLMResponses(script=Script(leak_previous=True))
    engine.traffic.prompts.append(f"victim prompt {FOREIGN.text} private")
    objs = _engine_events(engine, "attacker asks")
    _, step, out = _screen(_raw(objs), firewall())
    _assert_cut(step, out)


def test_a_leak_in_function_call_arguments_is_cut() -> None:
    engine = VLLMResponses(script=Script(text="ok"))
    engine.script.tool_calls = [ToolCall("f", f'{{"x": "{FOREIGN.text}"}}', pieces=9)]
    _, step, out = _screen(_raw(_engine_events(engine)), firewall())
    _assert_cut(step, out)


@pytest.mark.parametrize("where", ["done_text", "item_text", "final_text", "item_id", "name"])
def test_a_leak_only_in_a_repeat_or_an_identifier_is_cut(where: str) -> None:
    engine = VLLMResponses(script=Script(text="clean words"))
    engine.script.tool_calls = [ToolCall("f", "{}", pieces=1)]
    objs = _engine_events(engine)
    leak = f"clean words {FOREIGN.text}"
    for obj in objs:
        if where == "done_text" and obj["type"] == "response.output_text.done":
            obj["text"] = leak
        if where == "item_text" and obj["type"] == "response.output_item.done":
            obj["item"].get("content", [{}])[0]["text"] = leak
        if where == "final_text" and obj["type"] == "response.completed":
            obj["response"]["output"][0]["content"][0]["text"] = leak
        if where == "item_id" and obj["type"] == "response.output_text.delta":
            obj["item_id"] = f"msg_{FOREIGN.text}"
        if where == "name" and obj["type"] == "response.function_call_arguments.done":
            obj["name"] = f"f{FOREIGN.text}"
    _, step, out = _screen(_raw(objs), firewall())
    _assert_cut(step, out)


def test_extension_fields_are_dropped_not_relayed() -> None:
    engine = VLLMResponses(script=Script(text="fine"))
    objs = _engine_events(engine)
    for obj in objs:
        obj["vendor_note"] = f"{FOREIGN.text}"  # never screened: never sent
    _, step, out = _screen(_raw(objs), firewall())
    assert step.end is Phase.COMPLETED and b"vendor_note" not in out
    check_response_events(out)


def test_an_event_type_the_gateway_cannot_screen_fails_the_stream() -> None:
    engine = VLLMResponses(script=Script(text="fine"))
    objs = _engine_events(engine)
    objs.insert(
        3, {"type": "response.web_search_call.searching", "item_id": "x", "output_index": 0}
    )
    _, step, out = _screen(_raw(objs))
    check_response_events(out)
    assert step.end is Phase.FAILED and step.code == "upstream_error"


def test_a_stream_without_its_terminal_event_fails() -> None:
    engine = VLLMResponses(script=Script(text="fine"))
    _, step, out = _screen(_raw(_engine_events(engine)[:-1]))
    events_out = check_response_events(out)
    assert step.end is Phase.FAILED and events_out[-1]["type"] == "response.failed"


def test_an_incomplete_answer_stays_incomplete() -> None:
    engine = VLLMResponses(script=Script(text=" ".join(["w"] * 20)))
    engine.traffic.prompts.append("x")
    objs = list(
        events({"input": "x", "max_output_tokens": 4}, engine, response_id="r", prompt_tokens=1)
    )
    _, step, out = _screen(_raw(objs))
    final = check_response_events(out)[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


FAILURE = {"code": "server_error", "message": "oom"}


def test_sglang_summaries_and_its_failed_event() -> None:
    """SGLang 0.5.23 also writes reasoning summaries, and ends a failure with response.failed."""
    where = {"item_id": "rs_1", "output_index": 0, "summary_index": 0}
    part = {"type": "summary_text", "text": ""}
    objs = [
        {"type": "response.created", "response": {}},
        {"type": "response.output_item.added", "output_index": 0,
         "item": {"id": "rs_1", "type": "reasoning", "summary": [], "status": "in_progress"}},
        {"type": "response.reasoning_summary_part.added", **where, "part": part},
        {"type": "response.reasoning_summary_text.delta", **where, "delta": f"sum {OWN.text}"},
        {"type": "response.reasoning_summary_text.done", **where, "text": f"sum {OWN.text}"},
        {"type": "response.reasoning_summary_part.done", **where,
         "part": {"type": "summary_text", "text": f"sum {OWN.text}"}},
        {"type": "response.failed", "response": {"error": FAILURE}},
    ]  # fmt: skip
    _, step, out = _screen(_raw(objs), firewall())
    events_out = check_response_events(out)
    summary = [e for e in events_out if e["type"] == "response.reasoning_summary_part.done"]
    assert summary[0]["part"]["text"] == "sum "
    assert step.end is Phase.FAILED
    assert events_out[-1]["response"]["error"]["message"].endswith("(server_error): oom")


async def test_a_whole_answer_from_the_standin_is_screened_and_valid() -> None:
    engine = VLLMResponses(script=Script(text=f"plain {OWN.text} text"))
    upstream = native_body(body(input="q"), history=[], max_output_tokens=32, profile=Profile.VLLM)
    response = await _post(engine, upstream)
    stream = NativeStream(env(), firewall(), stream=False)
    step = stream.whole_answer(response.json())
    assert step.end is Phase.COMPLETED and step.out == b""
    final = check("Response", stream.response)
    assert final["output"][0]["content"][0]["text"] == "plain  text "


def test_text_held_back_to_the_end_is_in_the_final_output() -> None:
    """A text that only the final response carries (a whole answer) ends with a "C" the
    firewall holds back until the end: it is delivered, not lost."""
    engine = VLLMResponses(script=Script(text="ends with ABC"))
    final = _engine_events(engine)[-1]["response"]
    final["output"][0]["content"][0]["text"] = "ends with ABC"
    stream = NativeStream(env(), firewall(), stream=False)
    assert stream.whole_answer(final).end is Phase.COMPLETED
    assert stream.response is not None
    assert stream.response["output"][0]["content"][0]["text"] == "ends with ABC"
    cut = NativeStream(env(), firewall(), stream=False)
    final["output"][0]["content"][0]["text"] = "ends with " + FOREIGN.text[:20]
    assert cut.whole_answer(final).end is Phase.CUT


@pytest.mark.parametrize("split", [8, 13, 20])
def test_a_marker_split_between_an_engine_failures_code_and_message_is_cut(split: int) -> None:
    """An engine's failure goes out as one message, ``the engine failed (CODE): MESSAGE``: it is
    screened as that one text, so a marker whose first part ends the code and whose rest begins
    the message (folded, the ``): `` between them is nothing) is cut, never shown across them."""
    failure = {"code": f"oops {FOREIGN.text[:split]}", "message": f"{FOREIGN.text[split:]} done"}
    for last in (
        {"type": "response.failed", "response": {"error": failure}},
        {"type": "error", **failure},
    ):
        objs = [{"type": "response.created", "response": {}}, last]
        _, step, out = _screen(_raw(objs), firewall())
        _assert_cut(step, out)


@pytest.mark.parametrize(
    ("name", "call_id"), [("get weather", None), ("f" * 65, None), ("f", ""), ("f", "c" * 257)]
)
def test_a_function_call_no_later_turn_could_send_back_fails_the_answer(name, call_id) -> None:
    """A final function call whose name or call id a continuation could not send back (it
    would be refused as input, for ever, by every turn of its chain) is an upstream error,
    streamed or whole: never renamed, never a completed Response (nothing to store)."""
    engine = VLLMResponses(script=Script(text="ok"))
    engine.script.tool_calls = [ToolCall(name, "{}", pieces=1)]
    objs = _engine_events(engine)
    for obj in objs:
        items = [obj.get("item") or {}, *obj.get("response", {}).get("output", [])]
        for item in items:
            if item.get("type") == "function_call" and call_id is not None:
                item["call_id"] = call_id
    stream, step, out = _screen(_raw(objs))
    events_out = check_response_events(out)
    assert step.end is Phase.FAILED and step.code == "upstream_error"
    assert [e["type"] for e in events_out[-2:]] == ["error", "response.failed"]
    assert stream.response is not None and stream.response["status"] == "failed"
    whole = NativeStream(env(), passthrough, stream=False)
    step = whole.whole_answer(objs[-1]["response"])
    assert step.end is Phase.FAILED and step.code == "upstream_error"
