"""OpenAI-compatible request and response shapes of the engine's HTTP edge.

Unknown fields are refused (a typo must not silently change behaviour); every numeric field has
bounds, so a negative or huge ``max_tokens`` is a 400 with the field named, not an engine error.
A temperature above 0 but below ``MIN_SAMPLING_TEMPERATURE`` is served greedily (its limit):
dividing float32 logits by it overflows to inf and would fail the whole batch's step.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backend.core.request import MIN_SAMPLING_TEMPERATURE

MAX_STOP_SEQUENCES = 4
MAX_TOKENS_CEILING = 1 << 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] = 16
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = Field(default=None, max_length=256)

    @field_validator("temperature")
    @classmethod
    def _greedy_below_floor(cls, value: float) -> float:
        return 0.0 if value < MIN_SAMPLING_TEMPERATURE else value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: str = Field(min_length=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = Field(default=None, max_length=64)

    def __repr__(self) -> str:
        return f"ChatMessage(role={self.role!r}, content=<{len(self.content)} chars>)"


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class HandoffProof(BaseModel):
    """What the serving path can prove about the KV it read (the gateway audits it)."""

    reserved_tokens: int
    transferred_tokens: int
    outcome: str
