"""OpenAI-compatible request bodies the gateway accepts (HTTP edge; tables live in db.models).

Strict and closed: unknown fields, wrong JSON types and out-of-range numbers are 400s naming the
field, before any engine is asked anything. What the engine receives is exactly the fields the
client set, plus the ``max_tokens`` the gateway enforced and the usage request it needs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.db.text import StoredText
from kvguard.http_edge import check_stops

MAX_TOKENS_CEILING = 1 << 20


def _unicode(value: str) -> str:
    """JSON may escape a lone UTF-16 surrogate (\\ud800); no engine can encode that text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text is not valid Unicode (it holds a lone surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]  # every free-text field of a request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: Text
    name: Text | None = Field(default=None, max_length=64)

    def __repr__(self) -> str:
        return f"ChatMessage(role={self.role!r}, content=<{len(self.content)} chars>)"

    __str__ = __repr__


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: StoredText = Field(min_length=1, max_length=256)  # in every audit row
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    user: Text | None = Field(default=None, max_length=256)
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    # vLLM/SGLang's prefix-cache salt: accepted for compatibility, never forwarded (the gateway
    # sets its own per tenant, gateway.engines.isolation)
    cache_salt: Text | None = Field(default=None, max_length=1024)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        check_stops([value] if isinstance(value, str) else (value or []))
        return value

    @model_validator(mode="after")
    def _one_max(self) -> _Sampling:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def wants_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def upstream_body(self, *, max_tokens: int) -> dict[str, Any]:
        """What the engine receives: the client's fields, the enforced max_tokens, usage on."""
        body = self.model_dump(exclude_unset=True, exclude={"max_completion_tokens", "cache_salt"})
        body["max_tokens"] = max_tokens
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # the gateway needs the counts
        return body


class ChatCompletionBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)

    def token_input(self) -> tuple[str | None, list[dict[str, Any]] | None]:
        return None, [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionBody(_Sampling):
    prompt: Text = Field(min_length=1)

    def __repr__(self) -> str:
        return f"CompletionBody(model={self.model!r}, prompt=<{len(self.prompt)} chars>)"

    def token_input(self) -> tuple[str | None, list[dict[str, Any]] | None]:
        return self.prompt, None
