"""The Response objects and stream events the gateway writes, after OpenAI's published schemas
(``Response``, ``ResponseUsage``, ``ResponseStreamEvent``).

- ids: ``resp_`` and the item prefixes (``msg_``, ``fc_``, ``rs_``) followed by 48 random hex
  digits (192 bits): unguessable, so an id proves nothing but is never enumerable;
- ``Envelope``: everything a Response object repeats from its request (model, instructions, tools,
  sampling, metadata...), built once per request from the client's body -- never from what an
  engine echoes -- with the gateway's own id; ``Envelope.response`` adds the status, output, usage
  and error of one moment (created, completed, failed...);
- ``usage``: a chat completion's ``usage`` as a Response's (input/output token details filled);
- ``check_call``: a function call an engine wrote is one a later turn can send back (the stored
  conversation is read as input: ``to_chat``), or the answer fails;
- ``sse``: one event as OpenAI and vLLM frame it (``event: <type>`` then ``data: <json>``; no
  ``[DONE]`` ends a Responses stream);
- ``failure_error``, ``error_event``: how a stream that must stop ends
  (``events.EventWriter.fail``): an ``error`` event naming the code (with an ``error`` object
  too, so OpenAI's SDKs raise it as an APIError instead of ending the iteration quietly) and a
  ``response.failed`` whose ``error`` (``server_error``, the one code of the published enum that
  fits) names the same code in its message. Never a truncated "completed".
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from gateway.openai.schemas import validated
from gateway.responses.schemas import CreateResponseBody, FunctionCallItem, FunctionTool
from gateway.responses.screening import InvalidAnswer

ID_HEX = 48
RESPONSE_ID = re.compile(rf"resp_[0-9a-f]{{{ID_HEX}}}")
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(ID_HEX // 2)}"


def is_response_id(value: str) -> bool:
    return RESPONSE_ID.fullmatch(value) is not None


def check_call(name: str, call_id: str) -> None:
    """A function call the engine wrote must read back as the ``FunctionCallItem`` a later turn
    sends it as (``to_chat``: a name of OpenAI's function-name form, a call id of 1 to 256
    characters); else ``InvalidAnswer``: the answer fails as an upstream error, neither renamed
    nor stored as a conversation that no continuation could send."""
    item = {"type": "function_call", "call_id": call_id, "name": name, "arguments": ""}
    try:
        validated(FunctionCallItem, item)
    except ValueError:
        raise InvalidAnswer("a function call that no later turn could send") from None


def dumps(obj: Any) -> str:
    return _COMPACT.encode(obj)


def sse(event_type: str, payload: str) -> bytes:
    """One SSE event: ``payload`` is the event's JSON text."""
    return f"event: {event_type}\ndata: {payload}\n\n".encode()


@dataclass(frozen=True, slots=True)
class Envelope:
    """The request-derived fields of every Response object of one request."""

    id: str
    created_at: int
    echo: dict[str, Any] = field(repr=False)

    def response(
        self,
        *,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete_reason: str | None = None,
        completed_at: int | None = None,
    ) -> dict[str, Any]:
        incomplete = {"reason": incomplete_reason} if incomplete_reason is not None else None
        response = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": completed_at,
            "error": error,
            "incomplete_details": incomplete,
            "output": output,
            **self.echo,
        }
        if usage is not None:  # ResponseUsage is not nullable: absent until known
            response["usage"] = usage
        return response


def envelope(
    body: CreateResponseBody, *, response_id: str, created_at: int, max_output_tokens: int | None
) -> Envelope:
    """The Envelope of ``body``: its own values, OpenAI's defaults where it gave none (the
    sampling values it did not set are null: the engine's defaults apply, which the gateway does
    not know). ``max_output_tokens``: the limit the gateway enforced."""
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}
    text.setdefault("format", {"type": "text"})
    tool_choice = body.tool_choice if body.tool_choice is not None else "auto"
    echo = {
        "model": body.model,
        "instructions": body.instructions,
        "metadata": dict(body.metadata or {}),
        "tools": [_tool(tool) for tool in body.function_tools()],
        "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning.model_dump(exclude_none=True) if body.reasoning else None,
        "text": text,
        "truncation": body.truncation or "disabled",
        "store": body.stores,
        "background": False,
        "service_tier": body.service_tier or "default",
        "safety_identifier": body.safety_identifier,
    }
    if body.user is not None:  # a string, not nullable, in the published Response
        echo["user"] = body.user
    return Envelope(response_id, created_at, echo)


def _tool(tool: FunctionTool) -> dict[str, Any]:
    """A tool as a Response echoes it: ``strict`` and ``parameters`` are required (nullable)."""
    return {
        **tool.model_dump(exclude_none=True),
        "strict": tool.strict,
        "parameters": tool.parameters,
    }


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def usage(chat_usage: dict[str, Any], *, hidden_prompt_tokens: int = 0) -> dict[str, Any]:
    """A chat ``usage`` object as a ``ResponseUsage``: ``hidden_prompt_tokens`` (a canary marker
    the gateway added) taken out of the input the tenant is shown."""
    prompt = max(0, _count(chat_usage.get("prompt_tokens")) - hidden_prompt_tokens)
    completion = _count(chat_usage.get("completion_tokens"))
    prompt_details = chat_usage.get("prompt_tokens_details")
    completion_details = chat_usage.get("completion_tokens_details")
    cached = _count(prompt_details.get("cached_tokens")) if isinstance(prompt_details, dict) else 0
    reasoning = (
        _count(completion_details.get("reasoning_tokens"))
        if isinstance(completion_details, dict)
        else 0
    )
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": min(cached, prompt), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": min(reasoning, completion)},
        "total_tokens": prompt + completion,
    }


def failure_error(code: str, message: str) -> dict[str, str]:
    """A failed Response's ``error``: ``server_error`` (the published enum has no code of ours),
    the gateway's code leading the message."""
    return {"code": "server_error", "message": f"{code}: {message}"}


def error_event(code: str, message: str, sequence_number: int) -> dict[str, Any]:
    return {
        "type": "error",
        "code": code,
        "message": message,
        "param": None,
        "sequence_number": sequence_number,
        "error": {"message": message, "type": "server_error", "param": None, "code": code},
    }
