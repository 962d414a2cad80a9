"""Engines whose capacity is declared, not measured: generic OpenAI-compatible servers and any
provider reached through litellm.

Nothing can be read from them, so the snapshot is the configured ``declared_max_model_len``,
marked ``measured=False``; the registry refuses such an engine unless its spec sets
``allow_unverified``. Liveness: an OpenAI-compatible engine must answer ``GET /v1/models``; a
litellm provider is not probed (its API may bill or rate-limit listing calls).

Token counts use a safe upper bound rather than a guess: every token of a byte-level or
byte-fallback tokenizer covers at least one UTF-8 byte, so bytes + a per-message allowance for
the chat template can only over-count. Over-counting refuses borderline requests; it never
admits one that does not fit.
"""

from __future__ import annotations

from typing import Any

import httpx

from gateway.config import EngineKind
from gateway.engines.adapters.base import EngineAdapter, get_json
from gateway.engines.capacity import CapacitySnapshot, RoleView

TEMPLATE_TOKENS_PER_MESSAGE = 16
SPECIAL_TOKENS = 16


def upper_bound_tokens(prompt: str | None, messages: list[dict[str, Any]] | None) -> int:
    if messages is None:
        return len((prompt or "").encode("utf-8")) + SPECIAL_TOKENS
    total = SPECIAL_TOKENS
    for message in messages:
        total += TEMPLATE_TOKENS_PER_MESSAGE
        for value in message.values():
            total += len(str(value).encode("utf-8"))
    return total


class DeclaredAdapter(EngineAdapter):
    async def introspect(self, client: httpx.AsyncClient, *, timeout: float) -> CapacitySnapshot:
        if self.spec.kind is EngineKind.OPENAI:
            await get_json(client, self.url("/v1/models"), timeout=timeout, headers=self.headers())
        assert self.spec.model is not None and self.spec.declared_max_model_len is not None
        return CapacitySnapshot(
            model=self.spec.model,
            context_window=self.spec.declared_max_model_len,
            roles=(RoleView(role="declared", pool_tokens=self.spec.declared_max_model_len),),
            measured=False,
        )

    async def count_tokens(
        self,
        client: httpx.AsyncClient,
        *,
        model: str,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> int:
        return upper_bound_tokens(prompt, messages)
