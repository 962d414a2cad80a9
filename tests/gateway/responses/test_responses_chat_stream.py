"""Chat answers as Responses (``gateway.responses.chat_stream``): the full event sequence, every
event and answer valid against OpenAI's published schemas, and screened by the real leak firewall:
the tenant's own marker stripped wherever the model wrote it (deltas, ``*.done`` texts, the final
response), another tenant's marker a failure that names the isolation code -- never a truncated
"completed"."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai_contract import check, check_response_events
from responses_helpers import FOREIGN, OWN, env, firewall, passthrough, split

from contracts.plugins import Cut
from gateway.lifecycle import Phase
from gateway.proxy.body import OFF_LOOP_CHARS, off_loop, on_loop
from gateway.responses.chat_stream import ChatToResponses

USAGE = {
    "prompt_tokens": 12,
    "completion_tokens": 7,
    "total_tokens": 19,
    "prompt_tokens_details": {"cached_tokens": 4},
}


def chunk(finish: str | None = None, **delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def call(index: int, *, name: str | None = None, args: str = "", id_: str | None = None) -> Any:
    function: dict[str, Any] = {"arguments": args}
    if name is not None:
        function["name"] = name
    entry: dict[str, Any] = {"index": index, "function": function, "type": "function"}
    if id_ is not None:
        entry["id"] = id_
    return entry


def run(chunks: list[dict[str, Any]], open_guard: Any = passthrough, *, done: bool = True):
    machine = ChatToResponses(env(), open_guard, hidden_prompt_tokens=2)
    out = machine.start()
    step = None
    for c in chunks:
        step = machine.feed(c)
        out += step.out
        if step.end is not None:
            return machine, step, out
    step = machine.done() if done else machine.upstream_ended()
    return machine, step, out + step.out


def test_a_text_answer_is_the_full_event_sequence_and_valid() -> None:
    chunks = [chunk(role="assistant", content=""), chunk(content="Hel"), chunk(content="lo")]
    chunks += [chunk("stop"), {"choices": [], "usage": USAGE}]
    machine, step, out = run(chunks)
    events = check_response_events(out)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert step.end is Phase.COMPLETED
    final = events[-1]["response"]
    assert final == machine.response
    check("Response", final)
    assert final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert events[6]["text"] == "Hello"
    assert final["usage"] == {
        "input_tokens": 10,  # 12 less the 2 the gateway's hooks added
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 17,
    }
    assert events[0]["response"]["id"] == final["id"] and final["id"].startswith("resp_")
    item_ids = {e["item_id"] for e in events if "item_id" in e}
    assert item_ids == {final["output"][0]["id"]}


def test_reasoning_text_refusal_and_parallel_tool_calls() -> None:
    chunks = [
        chunk(reasoning_content="think "),
        chunk(reasoning_content="more"),
        chunk(content="Sure."),
        chunk(refusal="no way"),
        chunk(tool_calls=[call(0, name="get", id_="call_a", args='{"a"')]),
        chunk(tool_calls=[call(1, name="put", id_="call_b")]),
        chunk(tool_calls=[call(0, args=": 1}")]),
        chunk(tool_calls=[call(1, args="{}")]),
        chunk("tool_calls"),
        {"choices": [], "usage": {**USAGE, "completion_tokens_details": {"reasoning_tokens": 3}}},
    ]
    machine, step, out = run(chunks)
    events = check_response_events(out)
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "think more"}]
    assert final["output"][1]["content"][1] == {"type": "refusal", "refusal": "no way"}
    calls = [(i["name"], i["call_id"], i["arguments"]) for i in final["output"][2:]]
    assert calls == [("get", "call_a", '{"a": 1}'), ("put", "call_b", "{}")]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in done] == [("get", '{"a": 1}'), ("put", "{}")]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [
        0,
        1,
        2,
        3,
    ]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    assert "response.refusal.done" in [e["type"] for e in events]


def test_length_finish_is_an_incomplete_response() -> None:
    machine, step, out = run(
        [chunk(content="cut sh"), chunk("length"), {"choices": [], "usage": USAGE}]
    )
    events = check_response_events(out)
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    assert step.end is Phase.COMPLETED


@pytest.mark.parametrize("step_size", [1, 3, 7])
def test_own_marker_is_stripped_from_deltas_done_texts_and_the_final_response(step_size) -> None:
    text = f"The code is {OWN.text}. Done."
    for offset in range(0, 9, 4):
        pieces = split(text, step_size, offset)
        args = f'{{"k": "{OWN.text}"}}'
        chunks = [chunk(content=p) for p in pieces]
        chunks += [chunk(tool_calls=[call(0, name="f", id_="c1")])]
        chunks += [chunk(tool_calls=[call(0, args=p)]) for p in split(args, step_size, offset)]
        chunks += [chunk("tool_calls")]
        machine, step, out = run(chunks, firewall())
        assert OWN.text[5:13].encode() not in out  # not even the owner tag
        events = check_response_events(out)
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert deltas == "The code is . Done."
        final = events[-1]["response"]
        assert final["output"][0]["content"][0]["text"] == "The code is . Done."
        assert final["output"][1]["arguments"] == '{"k": ""}'


def _assert_cut(step: Any, out: bytes) -> list[dict[str, Any]]:
    events = check_response_events(out)
    assert step.end is Phase.CUT and isinstance(step.cut, Cut)
    assert step.code == "isolation_violation"
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "isolation_violation"
    assert events[-2]["error"]["code"] == "isolation_violation"  # SDKs raise it
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["output"] == []
    assert failed["error"]["message"].startswith("isolation_violation: ")
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in events)
    body = FOREIGN.text[5:]
    assert body[:8].encode() not in out  # the victim's tag never reaches the client
    return events


@pytest.mark.parametrize("where", ["content", "reasoning_content", "refusal", "arguments", "name"])
def test_a_foreign_marker_anywhere_the_model_writes_is_a_failure_naming_the_code(where) -> None:
    leak = f"see {FOREIGN.text} now"
    if where == "arguments":
        chunks = [chunk(tool_calls=[call(0, name="f", id_="c")])]
        chunks += [chunk(tool_calls=[call(0, args=p)]) for p in split(leak, 3, 1)]
    elif where == "name":
        chunks = [chunk(tool_calls=[call(0, name=f"f{FOREIGN.text}", id_="c")])]
    else:
        chunks = [chunk(**{where: p}) for p in split(leak, 3, 1)]
    machine, step, out = run([chunk(content="ok "), *chunks, chunk("stop")], firewall())
    _assert_cut(step, out)
    assert machine.response is not None and machine.response["status"] == "failed"


def test_a_marker_cut_short_by_the_engine_still_cuts() -> None:
    chunks = [chunk(content="x " + FOREIGN.text[:20])]
    machine, step, out = run(chunks, firewall(), done=False)
    _assert_cut(step, out)


def test_a_stream_without_done_is_a_failure_not_a_completion() -> None:
    machine, step, out = run([chunk(content="partial")], done=False)
    events = check_response_events(out)
    assert step.end is Phase.FAILED and step.code == "upstream_error"
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]


def test_an_engine_error_event_ends_it_failed_with_its_code() -> None:
    error = {"error": {"message": "boom", "code": "engine_overloaded", "type": "server_error"}}
    machine, step, out = run([chunk(content="a"), error])
    events = check_response_events(out)
    assert step.end is Phase.FAILED and step.code == "engine_overloaded"
    assert events[-2]["message"] == "boom"


@pytest.mark.parametrize("split_at", [8, 10])
def test_a_marker_split_between_an_engine_errors_code_and_message_is_cut(split_at: int) -> None:
    """The failed Response's message is ``CODE: MESSAGE``: each is screened, and so is that text,
    so a marker whose first part ends the code and whose rest begins the message (folded, the
    ``: `` between them is nothing) is cut, never shown across them."""
    failure = {"code": f"x {FOREIGN.text[:split_at]}", "message": f"{FOREIGN.text[split_at:]} y"}
    _, step, out = run([chunk(content="a"), {"error": failure}], firewall())
    events = check_response_events(out)
    assert step.end is Phase.CUT and step.code == "isolation_violation"
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert FOREIGN.text[5:13].encode() not in out and b"x CNRY" not in out


@pytest.mark.parametrize(
    "bad",
    [
        {"choices": [{"index": 0, "delta": {"content": "a"}}, {"index": 1, "delta": {}}]},
        {"choices": [{"index": 1, "delta": {"content": "a"}}]},
        {"choices": [{"index": 0, "delta": {"content": 5}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {}}]}}]},
    ],
)
def test_a_chunk_the_gateway_cannot_vouch_for_fails_the_stream(bad) -> None:
    machine, step, out = run([bad])
    check_response_events(out)
    assert step.end is Phase.FAILED and step.code == "upstream_error"


def test_text_after_the_finish_fails_the_stream() -> None:
    machine, step, out = run([chunk("stop", content="a"), chunk(content="b")])
    assert step.end is Phase.FAILED


def test_a_whole_chat_completion_becomes_a_valid_response() -> None:
    completion = {
        "id": "chatcmpl-1",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": f"Calling {OWN.text}.",
                    "refusal": None,
                    "tool_calls": [
                        {
                            "id": "c9",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
            }
        ],
        "usage": USAGE,
    }
    machine = ChatToResponses(env(), firewall(), stream=False)
    assert machine.start() == b""
    step = machine.whole_answer(completion)
    assert step.end is Phase.COMPLETED and step.out == b""
    response = check("Response", machine.response)
    assert response["output"][0]["content"][0]["text"] == "Calling ."
    assert response["output"][1]["call_id"] == "c9"
    assert response["usage"]["input_tokens"] == 12


def test_a_whole_answer_with_a_foreign_marker_is_cut() -> None:
    completion = {"choices": [{"index": 0, "message": {"content": FOREIGN.text}}]}
    machine = ChatToResponses(env(), firewall(), stream=False)
    step = machine.whole_answer(completion)
    assert step.end is Phase.CUT
    assert machine.response is not None and machine.response["status"] == "failed"
    check("Response", machine.response)


def test_a_completed_answer_can_end_failed_in_place_of_its_terminal_event() -> None:
    """``fail_instead`` (the gateway could not store a completed answer): the terminal event is
    not sent, an ``error`` and a ``response.failed`` take its place, the numbers unbroken."""
    chunks = [chunk(content="Hello"), chunk("stop"), {"choices": [], "usage": USAGE}]
    machine, step, out = run(chunks)
    assert step.end is Phase.COMPLETED
    sent = out[: out.rfind(b"event: response.")]
    failed = machine.fail_instead("database_unavailable", "not stored")
    events = check_response_events(sent + failed.out)
    assert [e["type"] for e in events[-3:]] == [
        "response.output_item.done",
        "error",
        "response.failed",
    ]
    assert events[-2]["code"] == "database_unavailable" and failed.end is Phase.FAILED
    assert machine.response is not None and machine.response["status"] == "failed"


# what a later turn sends back (``FunctionCallItem``): OpenAI's function-name form, ids 1-256
UNSENDABLE_CALLS = [("get weather", "c1"), ("f" * 65, "c1"), ("wetter_für", "c1"), ("f", "c" * 257)]


def _whole_call(name: str, call_id: str) -> dict[str, Any]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}]}


@pytest.mark.parametrize(("name", "call_id"), UNSENDABLE_CALLS)
def test_a_tool_call_no_later_turn_could_send_back_fails_the_answer(name, call_id) -> None:
    """The engine's name and call id go out as it wrote them or not at all: a call that a
    continuation could not send back (it would be refused as input, for ever, by every turn
    of its chain) is an upstream error for this answer, streamed or whole, never renamed and
    never a completed Response (nothing to store)."""
    longest = "a.b-c_D9" + "x" * 56  # at the limits: still a call
    chunks = [chunk(tool_calls=[call(0, name=longest, id_="c" * 256, args="{}")]), chunk("stop")]
    machine, step, _ = run(chunks)
    assert step.end is Phase.COMPLETED and machine.response is not None
    assert machine.response["output"][0]["name"] == longest

    chunks = [chunk(content="let me see")]
    chunks += [chunk(tool_calls=[call(0, name=name, id_=call_id, args="{}")]), chunk("tool_calls")]
    machine, step, out = run(chunks)
    events = check_response_events(out)
    assert step.end is Phase.FAILED and step.code == "upstream_error"
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert not [e for e in events if e.get("item", {}).get("type") == "function_call"]
    assert machine.response is not None and machine.response["status"] == "failed"

    whole = ChatToResponses(env(), passthrough, stream=False)
    step = whole.whole_answer(_whole_call(name, call_id))
    assert step.end is Phase.FAILED and step.code == "upstream_error"
    assert whole.response is not None and whole.response["status"] == "failed"


async def test_a_long_whole_answer_goes_through_the_machine_off_the_loop() -> None:
    """A Responses request's whole answer of ``OFF_LOOP_CHARS`` or more goes through its machine
    in a worker thread (``gateway.proxy.body.off_loop``), its guards opened on the loop: the same
    Response as on the loop, the own marker stripped, a foreign one still a failure."""
    filler = "CNRY-A " * (OFF_LOOP_CHARS // 7 + 1)
    for text in (f"{filler}{OWN.text} end", f"{filler}{FOREIGN.text}"):
        completion = {"choices": [{"index": 0, "message": {"content": text}}], "usage": USAGE}
        on_the_loop = ChatToResponses(env(), firewall(), stream=False)
        expected = on_the_loop.whole_answer(completion)
        machine = ChatToResponses(env(), on_loop(firewall()), stream=False)
        size = len(json.dumps(completion))
        step = await off_loop(size, lambda m=machine, c=completion: m.whole_answer(c))
        assert (step.end, step.out) == (expected.end, expected.out)
        assert machine.response is not None and on_the_loop.response is not None
        assert without_ids(machine.response) == without_ids(on_the_loop.response)
        check("Response", machine.response)
        assert OWN.text not in json.dumps(machine.response)
        assert (step.end is Phase.CUT) is (FOREIGN.text in text)


def without_ids(value: Any) -> Any:
    """``value`` without its random parts (ids, the creation time)."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "created_at")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value
