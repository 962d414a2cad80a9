"""SGLang: ``GET /get_server_info`` for the real pool, ``GET /v1/models`` for the window.

``/get_server_info`` publishes the server arguments flattened at the top level (``page_size``,
``served_model_name``, ``context_length`` (often null: the model's own length applies),
``disaggregation_mode``) plus the scheduler's ``max_total_num_tokens`` (the KV pool in tokens)
and ``max_req_input_len`` (the longest prompt), repeated per data-parallel rank in
``internal_states``. ``/v1/models`` reports the effective ``max_model_len``. Newer releases also
serve ``/server_info``; the older path is tried first and the newer one on a 404.
"""

from __future__ import annotations

from typing import Any

import httpx

from gateway.engines.adapters.base import (
    AdapterError,
    EngineAdapter,
    get_json,
    optional_positive_int,
    positive_int,
)
from gateway.engines.capacity import CapacitySnapshot, RoleView

SERVER_INFO_PATHS = ("/get_server_info", "/server_info")


class SGLangAdapter(EngineAdapter):
    async def introspect(self, client: httpx.AsyncClient, *, timeout: float) -> CapacitySnapshot:
        info = await self._server_info(client, timeout=timeout)
        models = await get_json(
            client, self.url("/v1/models"), timeout=timeout, headers=self.headers()
        )
        return snapshot_from_sglang(info, models, check_model=self.check_model)

    async def _server_info(self, client: httpx.AsyncClient, *, timeout: float) -> dict[str, Any]:
        last: AdapterError | None = None
        for path in SERVER_INFO_PATHS:
            try:
                return await get_json(
                    client, self.url(path), timeout=timeout, headers=self.headers()
                )
            except AdapterError as exc:
                last = exc
                if "HTTP 404" not in str(exc):
                    raise
        assert last is not None
        raise last


def snapshot_from_sglang(
    info: dict[str, Any], models: dict[str, Any], *, check_model: Any = None
) -> CapacitySnapshot:
    where = "sglang server_info"
    pools = [positive_int(info, "max_total_num_tokens", where=where)]
    prompt_limits = [optional_positive_int(info, "max_req_input_len")]
    for state in info.get("internal_states") or []:
        if isinstance(state, dict):
            pools.append(optional_positive_int(state, "max_total_num_tokens") or pools[0])
            prompt_limits.append(optional_positive_int(state, "max_req_input_len"))
    card = _model_card(models, info.get("served_model_name"))
    model = str(card["id"])
    if check_model is not None:
        model = check_model(model)
    # /v1/models reports the effective length (a context_length override already applied).
    window = optional_positive_int(card, "max_model_len") or optional_positive_int(
        info, "context_length"
    )
    if window is None:
        raise AdapterError(f"{where}: no context_length and no max_model_len in /v1/models")
    known_prompt = [limit for limit in prompt_limits if limit is not None]
    mode = info.get("disaggregation_mode")
    role = mode if mode in ("prefill", "decode") else "unified"
    return CapacitySnapshot(
        model=model,
        context_window=window,
        roles=(RoleView(role=role, pool_tokens=min(pools), page_size=_page_size(info)),),
        measured=True,
        max_prompt_tokens=min(known_prompt) if known_prompt else None,
    )


def _model_card(models: dict[str, Any], served: Any) -> dict[str, Any]:
    cards = [card for card in models.get("data") or [] if isinstance(card, dict) and "id" in card]
    if not cards:
        raise AdapterError("sglang /v1/models lists no model")
    for card in cards:
        if card["id"] == served:
            return card
    return cards[0]


def _page_size(info: dict[str, Any]) -> int | None:
    return optional_positive_int(info, "page_size")
