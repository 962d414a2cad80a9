"""Engines whose capacity is declared, not measured: generic OpenAI-compatible servers and any
provider reached through litellm.

Nothing can be read from them, so the snapshot is the configured ``declared_max_model_len``,
marked ``measured=False``; the registry refuses such an engine unless its spec sets
``allow_unverified``. Liveness: an OpenAI-compatible engine must answer ``GET /v1/models``; a
litellm provider is not probed (its API may bill or rate-limit listing calls).

Token counts are an upper bound that never undercounts (``gateway.engines.provider_count``:
the model's own tiktoken encoding where it has one, else UTF-8 bytes), over the messages and the
definitions a provider writes into the prompt (tools, functions, tool_choice, function_call,
response_format); over-counting refuses borderline requests, it never admits one that does not
fit.
"""

from __future__ import annotations

from typing import Any

import httpx

from gateway.engines.adapters.base import EngineAdapter, get_json
from gateway.engines.capacity import CapacitySnapshot, RoleView
from gateway.engines.prompt import DEFINITIONS
from gateway.engines.provider_count import upper_bound_tokens
from gateway.engines.spec import EngineKind


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
        body: dict[str, Any],
        timeout: float,
        snapshot: CapacitySnapshot | None = None,
    ) -> int:
        definitions = {k: body[k] for k in DEFINITIONS if body.get(k) is not None}
        messages = body.get("messages")
        prompt = None if messages is not None else body.get("prompt")
        return upper_bound_tokens(
            self.spec.litellm_model or model, prompt, messages, definitions=definitions
        )
