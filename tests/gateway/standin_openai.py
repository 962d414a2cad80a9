"""Shared parts of the STAND-IN engines (tests only): scripted answers and OpenAI-shaped bodies.

The SGLang and vLLM stand-ins (``standin_sglang``, ``standin_vllm``) and the third-party provider
below build their completion bodies and stream chunks here, in the shapes of the OpenAI API
reference (``/work/shared/reference/openai-openapi.yaml``: ``CreateChatCompletionResponse``,
``CreateChatCompletionStreamResponse``, ``ChatCompletionMessageToolCallChunk``) with each
engine's own differences passed in (vLLM's first chunk carries ``role``; SGLang's does too; vLLM
adds ``stop_reason``). They are NOT the engines: they exist to drive the gateway's real code.

A test scripts an answer with ``Script``: fixed text (default: echo the last user message word by
word), tool-call deltas split into argument pieces, per-token logprobs, or text copied from the
previous request's prompt (a cross-request leak, to exercise the firewall).
"""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvguard.testing import RunningServer, serve

MESSAGE_OVERHEAD = 3  # the stand-in chat template: tokens per message besides its words
# The stand-in chat template's tools turn, in the style of the tool-calling templates vLLM and
# SGLang apply (Qwen2.5/Hermes: a system turn listing each tool's JSON between <tools> tags, then
# how to answer a call); like theirs, its words count as prompt tokens.
TOOLS_HEADER = "# Tools\nYou may call these functions (one JSON signature per line):\n<tools>"
TOOLS_FOOTER = (
    '</tools>\nTo call one, answer <tool_call>{"name": ..., "arguments": ...}</tool_call>'
)
NO_THINKING = "<think>\n\n</think>"  # what a Qwen3-style template adds when thinking is off


def tools_turn(tools: list[dict[str, Any]]) -> str:
    return "\n".join([TOOLS_HEADER, *(json.dumps(tool) for tool in tools), TOOLS_FOOTER])


def word_count(
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    *,
    tools: list[dict[str, Any]] | None = None,
    thinking: bool = True,
) -> int:
    """The stand-ins' tokenizer: one token per whitespace-separated word (+ per-message frame) of
    what their chat template renders: the messages, the tools turn when there are tools, the
    empty thinking block when the template is told thinking is off."""
    if messages is None:
        return len((prompt or "").split())
    count = sum(len(str(m.get("content", "")).split()) + MESSAGE_OVERHEAD for m in messages)
    if tools:
        count += len(tools_turn(tools).split()) + MESSAGE_OVERHEAD
    return count + (0 if thinking else len(NO_THINKING.split()))


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, streamed in ``pieces`` parts
    pieces: int = 3


@dataclass
class Script:
    text: str | None = None  # None: echo the last user message (or the prompt)
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: bool = False
    leak_previous: bool = False  # answer with the previous request's last user message


@dataclass
class Traffic:
    """What an engine saw (tests assert on it)."""

    paths: list[str] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    tokenize_bodies: list[dict[str, Any]] = field(default_factory=list)

    def hits(self, path: str) -> int:
        return self.paths.count(path)


def prompt_text(body: dict[str, Any]) -> str:
    """Everything the request's prompt holds (every message), as the engine would see it."""
    if "messages" in body:
        return " ".join(str(m.get("content", "")) for m in body["messages"])
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else ""


def _last_user(body: dict[str, Any]) -> str:
    if "messages" in body:
        users = [str(m.get("content", "")) for m in body["messages"] if m.get("role") == "user"]
        return users[-1] if users else ""
    return prompt_text(body)


def answer_words(body: dict[str, Any], script: Script, traffic: Traffic) -> list[str]:
    if script.leak_previous and len(traffic.prompts) >= 2:
        text = traffic.prompts[-2]  # another request's prompt: what a KV leak looks like
    elif script.text is not None:
        text = script.text
    else:
        text = _last_user(body)
    return text.split()[: answer_limit(body)]


def answer_limit(body: dict[str, Any]) -> int:
    """The answer's token limit as the engines read it: ``max_completion_tokens`` first (what
    SGLang's model gateway sends for a client's ``max_tokens``), then ``max_tokens``, else 16."""
    return int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _logprobs(word: str, *, chat: bool) -> dict[str, Any]:
    if chat:
        entry = {"token": word, "logprob": -0.25, "bytes": list(word.encode()), "top_logprobs": []}
        return {"content": [entry]}
    return {"tokens": [word], "token_logprobs": [-0.25], "top_logprobs": None, "text_offset": [0]}


def full_body(
    body: dict[str, Any], words: list[str], prompt_tokens: int, script: Script, *, model: str
) -> dict[str, Any]:
    chat = "messages" in body
    text = " ".join(words)
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "logprobs": None}
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if script.tool_calls:
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for i, call in enumerate(script.tool_calls)
            ]
            choice["finish_reason"] = "tool_calls"
        choice["message"] = message
    else:
        choice["text"] = text
    return {
        "id": "cmpl-standin",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_tokens, len(words)),
    }


def chunks(
    body: dict[str, Any],
    words: list[str],
    prompt_tokens: int,
    script: Script,
    *,
    model: str,
    extra_choice: dict[str, Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """Stream chunk objects: role chunk, text or tool-call deltas, finish, usage (if asked)."""
    chat = "messages" in body
    base = {
        "id": "cmpl-standin",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    extra = extra_choice or {}

    def choice(delta: dict[str, Any] | str, finish: str | None = None, **more: Any) -> dict:
        out: dict[str, Any] = {"index": 0, "finish_reason": finish, **extra, **more}
        out.update({"delta": delta} if chat else {"text": delta})
        return {**base, "choices": [out]}

    if chat:
        yield choice({"role": "assistant", "content": ""})
    for i, word in enumerate(words if not script.tool_calls else []):
        piece = word if i == 0 else " " + word
        more = {"logprobs": _logprobs(piece, chat=chat)} if script.logprobs else {}
        yield choice({"content": piece} if chat else piece, **more)
    for index, call in enumerate(script.tool_calls if chat else []):
        yield choice(
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": f"call_{index}",
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                ]
            }
        )
        size = max(1, -(-len(call.arguments) // call.pieces))
        for start in range(0, len(call.arguments), size):
            part = call.arguments[start : start + size]
            yield choice({"tool_calls": [{"index": index, "function": {"arguments": part}}]})
    finish = "tool_calls" if script.tool_calls and chat else "stop"
    yield choice({} if chat else "", finish)
    if (body.get("stream_options") or {}).get("include_usage"):
        yield {**base, "choices": [], "usage": usage(prompt_tokens, len(words))}


def sse(objects: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    for obj in objects:
        yield f"data: {json.dumps(obj)}\n\n".encode()
    yield b"data: [DONE]\n\n"


# -- a deployment: workers behind a router, each on a real 127.0.0.1 port --------------------------


@dataclass
class Deployment:
    """Workers (by name, with their role) and the router in front of them, all running."""

    router_server: RunningServer
    urls: dict[str, str]
    roles: dict[str, str]
    servers: list[RunningServer]

    @property
    def url(self) -> str:
        return self.router_server.url

    def members(self) -> list[dict[str, Any]]:
        """The ``members`` entries an operator writes for this deployment."""
        return [{"name": n, "role": self.roles[n], "url": self.urls[n]} for n in self.urls]

    async def stop(self) -> None:
        await self.router_server.stop()
        for server in self.servers:
            await server.stop()


async def serve_workers(apps: dict[str, FastAPI]) -> tuple[list[RunningServer], dict[str, str]]:
    servers, urls = [], {}
    for name, app in apps.items():
        server = await serve(app)
        servers.append(server)
        urls[name] = server.url
    return servers, urls


# -- a third-party provider (what litellm reaches) -------------------------------------------------


@dataclass
class ProviderControls:
    model: str = "gpt-4o-mini"
    script: Script = field(default_factory=Script)
    traffic: Traffic = field(default_factory=Traffic)


def provider_app(controls: ProviderControls) -> FastAPI:
    """An OpenAI-compatible THIRD-PARTY provider: records every header it is sent."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        controls.traffic.paths.append(request.url.path)
        controls.traffic.headers.append({k.lower(): v for k, v in request.headers.items()})
        controls.traffic.bodies.append(body)
        controls.traffic.prompts.append(prompt_text(body))
        words = answer_words(body, controls.script, controls.traffic)
        tokens = word_count(None, body.get("messages"))
        if body.get("stream"):
            return StreamingResponse(
                sse(chunks(body, words, tokens, controls.script, model=controls.model)),
                media_type="text/event-stream",
            )
        return JSONResponse(full_body(body, words, tokens, controls.script, model=controls.model))

    @app.post("/v1/embeddings")
    @app.post("/embeddings")
    async def embeddings(request: Request) -> Any:  # OpenAI's CreateEmbeddingResponse
        body = await request.json()
        controls.traffic.paths.append(request.url.path)
        controls.traffic.bodies.append(body)
        data, tokens = embedding_data(body, 8)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": body["model"], "usage": usage}

    return app


def embedding_inputs(body: dict[str, Any]) -> list[Any]:
    """``input`` as a list of inputs (a string, or one token-id array, is one input)."""
    value = body["input"]
    if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)):
        return [value]
    return list(value)


def embedding_tokens(item: Any) -> int:
    """The stand-ins' embedding tokenizer: one per word and CLS/SEP, or the token ids given."""
    return len(item.split()) + 2 if isinstance(item, str) else len(item)


def embedding_vector(item: Any, dimensions: int) -> list[float]:
    """A deterministic vector of the input (the stand-ins compute no meaning)."""
    seed = sum(map(ord, item)) if isinstance(item, str) else sum(item)
    return [((seed * (i + 7)) % 1000) / 1000.0 for i in range(dimensions)]


def embedding_data(body: dict[str, Any], dimensions: int) -> tuple[list[dict[str, Any]], int]:
    """The ``data`` list of an embeddings answer (``Embedding`` objects) and its prompt tokens;
    ``encoding_format`` "base64": each vector as little-endian float32 bytes in base64 (what the
    openai SDK asks for by default and decodes)."""
    inputs = embedding_inputs(body)
    size = int(body.get("dimensions") or dimensions)
    data = []
    for i, item in enumerate(inputs):
        vector: Any = embedding_vector(item, size)
        if body.get("encoding_format") == "base64":
            vector = base64.b64encode(struct.pack(f"<{size}f", *vector)).decode()
        data.append({"index": i, "object": "embedding", "embedding": vector})
    return data, sum(embedding_tokens(item) for item in inputs)
