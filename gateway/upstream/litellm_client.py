"""litellm path: ``litellm.acompletion``/``atext_completion``/``aembedding`` for providers that
need translation.

litellm is imported on first use (it takes seconds to import) and always offline: its model cost
map is read from the package and nothing is fetched at run time (``LITELLM_LOCAL_MODEL_COST_MAP``
and ``LITELLM_OFFLINE_MODE`` are set before the import). Streamed chunks are re-serialised as
OpenAI SSE events; errors are mapped to a status and an OpenAI-style body (a litellm
context-window error keeps the ``context_length_exceeded`` code).

What reaches the provider is only what it needs: no ``api_key`` unless the engine holds one (else
litellm reads the provider's own credentials from the environment, e.g. ``OPENAI_API_KEY``), no
``api_base`` when the spec says the provider's own endpoint applies, and none of the gateway's
tenant/request/trace headers unless the operator opted in (``send_kvguard_headers``).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

from contracts.sse import DONE, encode_event
from gateway.upstream.base import (
    Endpoint,
    Upstream,
    UpstreamCall,
    UpstreamReply,
    UpstreamStream,
    UpstreamUnreachable,
)

_litellm: ModuleType | None = None

# Fields of the OpenAI body litellm takes as keyword arguments (the rest is refused upstream).
_PASSED = (
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "presence_penalty",
    "frequency_penalty",
)
_EMBEDDING_PASSED = ("input", "dimensions", "encoding_format", "user")


def load_litellm() -> ModuleType:
    global _litellm
    if _litellm is None:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")
        import litellm

        litellm.telemetry = False
        _litellm = litellm
    return _litellm


def _kwargs(call: UpstreamCall, *, timeout_s: float) -> dict[str, Any]:
    spec = call.spec
    passed = _EMBEDDING_PASSED if call.endpoint is Endpoint.EMBEDDINGS else _PASSED
    kwargs: dict[str, Any] = {k: call.body[k] for k in passed if k in call.body}
    kwargs["model"] = spec.litellm_model or f"openai/{call.body['model']}"
    if spec.api_base:
        kwargs["api_base"] = spec.base_url
    headers = call.outgoing_headers()
    if headers:
        kwargs["extra_headers"] = headers
    kwargs["timeout"] = timeout_s
    key = spec.key()
    if key is not None:
        kwargs["api_key"] = key
    if call.endpoint is Endpoint.CHAT:
        kwargs["messages"] = call.body["messages"]
    elif call.endpoint is Endpoint.COMPLETIONS:
        kwargs["prompt"] = call.body["prompt"]
    return kwargs


def _error_reply(exc: Exception) -> UpstreamReply:
    status = getattr(exc, "status_code", None)
    if not isinstance(status, int) or status < 400:
        raise UpstreamUnreachable(exc.__class__.__name__) from exc
    name = exc.__class__.__name__
    code = "context_length_exceeded" if "ContextWindow" in name else "upstream_error"
    message = getattr(exc, "message", None) or name
    body = {
        "error": {"message": str(message)[:500], "type": "upstream", "param": None, "code": code}
    }
    return UpstreamReply(status=status, body=body)


class LiteLLMStream(UpstreamStream):
    def __init__(self, wrapper: Any) -> None:
        self._wrapper = wrapper

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._wrapper:
                yield encode_event(chunk.model_dump_json(exclude_none=True))
        except Exception as exc:
            raise UpstreamUnreachable(f"stream broke: {exc.__class__.__name__}") from exc
        yield encode_event(DONE)

    async def aclose(self) -> None:
        closer = getattr(self._wrapper, "aclose", None)
        if closer is not None:
            try:
                await closer()
            except Exception:  # closing a half-read provider stream must not mask the outcome
                return


class LiteLLMUpstream(Upstream):
    def __init__(self, *, timeout_s: float) -> None:
        self._timeout_s = timeout_s

    async def _call(self, call: UpstreamCall) -> Any:
        litellm = load_litellm()
        kwargs = _kwargs(call, timeout_s=self._timeout_s)
        if call.endpoint is Endpoint.CHAT:
            return await litellm.acompletion(**kwargs)
        if call.endpoint is Endpoint.EMBEDDINGS:
            return await litellm.aembedding(**kwargs)
        return await litellm.atext_completion(**kwargs)

    async def complete(self, call: UpstreamCall) -> UpstreamReply:
        try:
            response = await self._call(call)
        except UpstreamUnreachable:
            raise
        except Exception as exc:
            return _error_reply(exc)
        return UpstreamReply(status=200, body=response.model_dump(exclude_none=True))

    async def stream(self, call: UpstreamCall) -> UpstreamStream | UpstreamReply:
        try:
            wrapper = await self._call(call)
        except Exception as exc:
            return _error_reply(exc)
        return LiteLLMStream(wrapper)
