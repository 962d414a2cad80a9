"""The shapes of OpenAI's answers and chunks that the relays (``gateway.proxy.relay``, ``.body``)
read and write: how many choices and which indexes an answer may have, usage counts and the usage
a tenant is shown, a choice's text in a chunk or a whole answer, a chunk with its texts replaced,
the chunk that carries a choice's held-back tail, and the keys OpenAI's published schemas require
that an engine left out."""

from __future__ import annotations

from typing import Any

from contracts.plugins import Emit
from gateway.upstream.base import Endpoint

MAX_CHOICES = 16


class InvalidUpstream(ValueError):
    """An engine answer the gateway cannot vouch for (the message names no content)."""


def choice_index(choice: Any, position: int) -> int:
    """A choice's ``index`` (its position when it has none), checked: ``InvalidUpstream`` if not
    a number below ``MAX_CHOICES``."""
    if not isinstance(choice, dict):
        raise InvalidUpstream("a choice is not an object")
    index = choice.get("index", position)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_CHOICES:
        raise InvalidUpstream("a choice index is out of range")
    return index


def own_usage(obj: dict[str, Any], hidden: int) -> dict[str, Any]:
    """``obj`` (an answer or a chunk) with its ``usage`` as the tenant's own: the ``hidden`` prompt
    tokens the gateway's hooks added (a canary marker) taken out of ``prompt_tokens`` and
    ``total_tokens``. A copy; ``obj`` is left as it is."""
    usage = dict(obj["usage"])
    for name in ("prompt_tokens", "total_tokens"):
        if (count := token_count(usage.get(name))) is not None:
            usage[name] = max(0, count - hidden)
    return {**obj, "usage": usage}


def token_count(value: Any) -> int | None:
    """A usage count as an engine sent it: an integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def fill_required(endpoint: Endpoint, choices: list[dict[str, Any]]) -> None:
    """Keys OpenAI's published answer schemas require and some engines leave out, as null: a
    choice's ``logprobs``, a chat message's ``refusal`` (SGLang sends neither)."""
    for choice in choices:
        choice.setdefault("logprobs", None)
        fill_logprobs(endpoint, choice)
        message = choice.get("message")
        if endpoint is Endpoint.CHAT and isinstance(message, dict):
            message.setdefault("refusal", None)


def fill_logprobs(endpoint: Endpoint, choice: dict[str, Any]) -> bool:
    """A chat choice's ``logprobs`` object gets the ``content`` and ``refusal`` lists the schemas
    require (null when the engine left them out: vLLM sends no ``refusal``); True if it changed."""
    logprobs = choice.get("logprobs")
    if endpoint is not Endpoint.CHAT or not isinstance(logprobs, dict):
        return False
    if "content" in logprobs and "refusal" in logprobs:
        return False
    choice["logprobs"] = {"content": None, "refusal": None, **logprobs}
    return True


def chunk_text(endpoint: Endpoint, choice: dict[str, Any]) -> str:
    if endpoint is Endpoint.CHAT:
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else None
    else:
        content = choice.get("text")
    return content if isinstance(content, str) else ""


def message_text(endpoint: Endpoint, choice: dict[str, Any]) -> str:
    if endpoint is Endpoint.CHAT:
        message = choice.get("message")
        content = message.get("content") if isinstance(message, dict) else None
    else:
        content = choice.get("text")
    return content if isinstance(content, str) else ""


def set_message_text(endpoint: Endpoint, choice: dict[str, Any], text: str) -> None:
    if endpoint is Endpoint.CHAT:
        choice.setdefault("message", {})["content"] = text
    else:
        choice["text"] = text


def with_texts(endpoint: Endpoint, obj: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """A copy of the chunk with the choices' texts replaced (only the changed path is copied)."""
    chunk = dict(obj)
    chunk["choices"] = choices = [dict(choice) for choice in obj["choices"]]
    for choice, text in zip(choices, texts, strict=True):
        if endpoint is Endpoint.CHAT:
            raw_delta = choice.get("delta")
            delta: dict[str, Any] = raw_delta if isinstance(raw_delta, dict) else {}
            if text or "content" in delta:
                choice["delta"] = {**delta, "content": text}
        else:
            choice["text"] = text
    return chunk


def text_tail_chunk(
    endpoint: Endpoint, template: dict[str, Any], index: int, tail: Emit
) -> dict[str, Any]:
    chunk = {k: v for k, v in template.items() if k not in ("choices", "usage")}
    choice: dict[str, Any] = {"index": index, "finish_reason": None}
    if endpoint is Endpoint.CHAT:
        choice["delta"] = {"content": tail.text}
    else:
        choice["text"], choice["logprobs"] = tail.text, None  # both required by the schema
    chunk["choices"] = [choice]
    return chunk


CHUNK_OBJECT = {True: "chat.completion.chunk", False: "text_completion"}


def more_than_text(endpoint: Endpoint, choice: Any) -> bool:
    """A streamed choice that carries anything besides its text (a role, tool calls, logprobs,
    reasoning, a finish): its event goes out even when the guard holds back all of its text."""
    if not isinstance(choice, dict):
        return False
    for key, value in choice.items():
        if key == "index" or value is None:
            continue
        if endpoint is Endpoint.CHAT and key == "delta" and isinstance(value, dict):
            if any(v is not None for k, v in value.items() if k != "content"):
                return True
        elif endpoint is Endpoint.CHAT or key != "text":
            return True
    return False
