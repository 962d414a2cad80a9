"""STAND-IN for vLLM's ``/v1/responses`` routes (tests only; not vLLM).

Shapes and behaviour follow vLLM 0.33.0, read from its wheel:

- ``entrypoints/openai/responses/api_router.py``: ``POST /v1/responses`` (a ``ResponsesResponse``
  as JSON, or SSE events framed ``event: <type>\\ndata: <json>\\n\\n``, no ``[DONE]``),
  ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``; errors as ``ErrorResponse``
  (``{"error": {message, type, param, code}}`` with the HTTP status as ``code``).
- ``entrypoints/openai/responses/serving.py``: ``store`` is silently turned off unless the server
  runs with ``VLLM_ENABLE_RESPONSES_API_STORE`` (``enable_store`` here); stored responses live in
  a process dict keyed by response id ALONE (``response_store``, ``msg_store``) -- any caller that
  knows an id continues or reads that conversation, which is exactly why the gateway never
  forwards ``previous_response_id``; a missing id is a 404 "Response with id '...' not found."
  (``_make_not_found_error``); ``cancel`` of a finished response is a 400 "Cannot cancel a
  synchronous response."; ``previous_response_id`` renders the stored messages and the previous
  output's text as assistant turns (``utils.py`` ``construct_input_messages``).
- ``entrypoints/openai/responses/streaming_events.py`` (``SimpleStreamingEventProcessor``):
  created, in_progress, then per item ``output_item.added`` (+ ``content_part.added`` for text),
  deltas, ``*.done``, ``content_part.done``, ``output_item.done``; reasoning as a ``reasoning``
  item with a ``reasoning_text`` part; a function call as ``function_call`` (``fc_`` ids,
  ``function_call_arguments.delta/.done``); then ``response.completed``, or
  ``response.incomplete`` (``incomplete_details.reason`` "max_output_tokens") when the answer hit
  the limit. ``ResponsesResponse.from_request`` echoes the request and adds vLLM's own fields
  (``background``, ``kv_transfer_params``, ``input_messages``...).

The answer is scripted as the other stand-ins' (``standin_openai.Script``): a fixed text, tool
calls, or another request's prompt (``leak_previous``: what a KV leak looks like).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from standin_openai import Script, Traffic
from standin_vllm import VLLMWorker, worker_app

from kvguard.testing import RunningServer, serve

VERSION = "0.33.0"


@dataclass
class VLLMResponses:
    model: str = "qwen3-32b"
    enable_store: bool = False  # VLLM_ENABLE_RESPONSES_API_STORE
    reasoning: str | None = None  # a reasoning text before the answer
    script: Script = field(default_factory=Script)
    traffic: Traffic = field(default_factory=Traffic)
    store: dict[str, dict[str, Any]] = field(default_factory=dict)  # response id -> response
    messages: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # id -> its input


def _not_found(response_id: str) -> JSONResponse:
    error = {
        "message": f"Response with id '{response_id}' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    return JSONResponse({"error": error}, status_code=404)


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    return [p.get("text", "") for p in content or [] if isinstance(p, dict)]


def render(body: dict[str, Any], engine: VLLMResponses) -> list[dict[str, Any]]:
    """The chat messages vLLM renders (``construct_input_messages``)."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    previous = body.get("previous_response_id")
    if previous is not None:
        messages += [m for m in engine.messages.get(previous, []) if m["role"] != "system"]
        for item in engine.store[previous]["output"]:
            if item["type"] == "message":
                messages += [{"role": "assistant", "content": t} for t in _texts(item["content"])]
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items:
        if item.get("type") == "function_call_output":
            messages.append({"role": "tool", "content": item["output"]})
        elif item.get("type") == "function_call":
            messages.append({"role": "assistant", "content": item["arguments"]})
        elif "role" in item:
            messages.append({"role": item["role"], "content": " ".join(_texts(item["content"]))})
    return messages


def _answer(body: dict[str, Any], engine: VLLMResponses, prompt: str) -> tuple[list[str], bool]:
    limit = int(body.get("max_output_tokens") or 16)
    if engine.script.leak_previous and len(engine.traffic.prompts) >= 2:
        text = engine.traffic.prompts[-2]
    elif engine.script.text is not None:
        text = engine.script.text
    else:
        users = [t for t in prompt.split("\n") if t]
        text = users[-1] if users else ""
    words = text.split()
    return [w + " " for w in words[:limit]], len(words) > limit


def response_object(
    body: dict[str, Any], engine: VLLMResponses, *, response_id: str, status: str, output: list
) -> dict[str, Any]:
    """``ResponsesResponse.from_request``: the echo, vLLM's extra fields."""
    return {
        "id": response_id,
        "created_at": 1_700_000_000,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": engine.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []),
        "top_p": body.get("top_p", 1.0),
        "background": False,
        "max_output_tokens": body.get("max_output_tokens") or 16,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning"),
        "service_tier": "auto",
        "status": status,
        "text": body.get("text"),
        "top_logprobs": 0,
        "truncation": "disabled",
        "usage": None,
        "user": None,
        "kv_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def events(
    body: dict[str, Any], engine: VLLMResponses, *, response_id: str, prompt_tokens: int
) -> Iterator[dict[str, Any]]:
    """The event sequence ``responses_stream_generator`` writes for this answer."""
    words, cut_short = _answer(body, engine, engine.traffic.prompts[-1])
    status = "incomplete" if cut_short else "completed"
    initial = response_object(
        body, engine, response_id=response_id, status="in_progress", output=[]
    )
    yield {"type": "response.created", "response": initial}
    yield {"type": "response.in_progress", "response": initial}
    output: list[dict[str, Any]] = []
    if engine.reasoning is not None:
        yield from _text_item(output, "reasoning", engine.reasoning.split(" "), "completed")
    if words:
        yield from _text_item(output, "message", words, status)
    for call in engine.script.tool_calls:
        yield from _call_item(output, call.name, call.arguments, call.pieces)
    final = response_object(body, engine, response_id=response_id, status=status, output=output)
    completion = len(words) + sum(len(c.arguments) for c in engine.script.tool_calls)
    final["usage"] = {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0},
        "total_tokens": prompt_tokens + completion,
    }
    yield {"type": f"response.{status}", "response": final}


def _text_item(output: list, kind: str, pieces: list[str], status: str) -> Iterator[dict[str, Any]]:
    index, item_id = len(output), f"{'rs' if kind == 'reasoning' else 'msg'}_{uuid.uuid4().hex}"
    where = {"item_id": item_id, "output_index": index, "content_index": 0}
    part_kind, prefix = ("reasoning_text", "response.reasoning_text") if kind == "reasoning" else (
        "output_text", "response.output_text")  # fmt: skip
    extra = {"logprobs": []} if part_kind == "output_text" else {}
    empty = {"type": part_kind, "text": "", **({"annotations": []} if extra else {}), **extra}
    if kind == "reasoning":
        added = {"id": item_id, "type": "reasoning", "summary": [], "status": "in_progress"}
    else:
        added = {"id": item_id, "type": "message", "role": "assistant", "content": []}
        added["status"] = "in_progress"
    yield {"type": "response.output_item.added", "output_index": index, "item": added}
    yield {"type": "response.content_part.added", **where, "part": empty}
    for piece in pieces:
        yield {"type": f"{prefix}.delta", **where, "delta": piece, **extra}
    text = "".join(pieces)
    yield {"type": f"{prefix}.done", **where, "text": text, **extra}
    part = {**empty, "text": text}
    yield {"type": "response.content_part.done", **where, "part": part}
    item = {**added, "status": status}
    item["content"] = [part]
    output.append(item)
    yield {"type": "response.output_item.done", "output_index": index, "item": item}


def _call_item(output: list, name: str, arguments: str, pieces: int) -> Iterator[dict[str, Any]]:
    index, item_id = len(output), f"fc_{uuid.uuid4().hex}"
    call_id = f"call_{uuid.uuid4().hex[:24]}"
    item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name}
    yield {
        "type": "response.output_item.added",
        "output_index": index,
        "item": {**item, "arguments": "", "status": "in_progress"},
    }
    where = {"item_id": item_id, "output_index": index}
    step = max(1, -(-len(arguments) // pieces))
    for start in range(0, len(arguments), step):
        delta = arguments[start : start + step]
        yield {"type": "response.function_call_arguments.delta", **where, "delta": delta}
    yield {
        "type": "response.function_call_arguments.done",
        **where,
        "arguments": arguments,
        "name": name,
    }
    done = {**item, "arguments": arguments, "status": "completed"}
    output.append(done)
    yield {"type": "response.output_item.done", "output_index": index, "item": done}


def sse(objects: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    for sequence, obj in enumerate(objects):
        obj = {**obj, "sequence_number": sequence}
        yield f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()


def responses_app(engine: VLLMResponses) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/responses")
    async def create(request: Request) -> Any:
        body = await request.json()
        engine.traffic.paths.append(request.url.path)
        engine.traffic.bodies.append(body)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in engine.store:
            return _not_found(previous)
        messages = render(body, engine)
        engine.traffic.prompts.append("\n".join(str(m["content"]) for m in messages))
        response_id = f"resp_{uuid.uuid4().hex}"
        tokens = sum(len(str(m["content"]).split()) for m in messages)
        produced = list(events(body, engine, response_id=response_id, prompt_tokens=tokens))
        if body.get("store", True) and engine.enable_store:
            engine.store[response_id] = produced[-1]["response"]
            engine.messages[response_id] = messages
        if body.get("stream"):
            return StreamingResponse(sse(iter(produced)), media_type="text/event-stream")
        return produced[-1]["response"]

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Any:
        stored = engine.store.get(response_id)
        return stored if stored is not None else _not_found(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> Any:
        if response_id not in engine.store:
            return _not_found(response_id)
        error = {
            "message": "Cannot cancel a synchronous response.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 400,
        }
        return JSONResponse({"error": error}, status_code=400)

    return app


async def serve_vllm(engine: VLLMResponses) -> RunningServer:
    """One vLLM stand-in process image: the worker's routes (models, metrics, tokenize) and the
    Responses routes, as one ``vllm serve`` answers them."""
    app = worker_app(VLLMWorker(model=engine.model, script=engine.script, traffic=engine.traffic))
    own = {route.path for route in app.router.routes}  # type: ignore[attr-defined]
    for route in responses_app(engine).router.routes:
        if route.path not in own:  # type: ignore[attr-defined]
            app.router.routes.append(route)
    return await serve(app)
