"""OpenAI-compatible routes: the models and the stored responses (``gateway.api.routes.responses``)
on FastAPI; chat completions, completions and ``POST /v1/responses`` are the data plane's
(``gateway.proxy.door``), declared here for the OpenAPI document."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gateway.api.routes import responses
from gateway.deps import CurrentTenant, StateDep
from gateway.domain import Principal
from gateway.engines.capacity import max_request_tokens_for
from gateway.errors import GatewayError, ModelNotFound
from gateway.openai.schemas import ChatCompletionBody, CompletionBody
from gateway.responses.schemas import CreateResponseBody
from gateway.state import GatewayState

router = APIRouter(prefix="/v1", tags=["openai"])


# The completion routes are served below FastAPI (``gateway.proxy.door``: ``GatewayApp`` sends
# these paths there before routing). They are declared here for the OpenAPI document only (its
# schemas, the tenant's bearer key), which clients, the SDK contract tests and the fuzzer read.


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionBody, principal: CurrentTenant) -> None:
    raise GatewayError("served by the data plane (gateway.proxy.door), not by this route")


@router.post("/completions", response_model=None)
async def completions(body: CompletionBody, principal: CurrentTenant) -> None:
    raise GatewayError("served by the data plane (gateway.proxy.door), not by this route")


@router.post("/responses", response_model=None)
async def create_response(body: CreateResponseBody, principal: CurrentTenant) -> None:
    raise GatewayError("served by the data plane (gateway.proxy.door), not by this route")


router.include_router(responses.router)  # the stored responses: GET, DELETE, input_items, cancel


@router.get("/models")
async def list_models(principal: CurrentTenant, state: StateDep) -> dict[str, Any]:
    """Models with a routable engine; ``max_model_len`` is what this tenant can really use:
    the smallest real limit across the engines serving it, capped by the tenant's plan."""
    return {"object": "list", "data": list(_model_cards(principal, state).values())}


@router.get("/models/{model:path}")
async def retrieve_model(model: str, principal: CurrentTenant, state: StateDep) -> dict[str, Any]:
    """One model's card, as in the list (404 ``model_not_found`` when no engine serves it)."""
    card = _model_cards(principal, state).get(model)
    if card is None:
        raise ModelNotFound(f"model '{model[:256]}' is not served here", param="model")
    return card


def _model_cards(principal: Principal, state: GatewayState) -> dict[str, dict[str, Any]]:
    cap = principal.plan.max_context_tokens
    cards = {}
    for model, records in sorted(state.registry.routable_models().items()):
        limits = [max_request_tokens_for(r.snapshot, cap) for r in records if r.snapshot]
        if limits:
            cards[model] = {
                "id": model,
                "object": "model",
                "created": 0,
                "owned_by": "kvguard",
                # OpenAI-compatible clients (vLLM's card) read the limit under this name
                "max_model_len": min(limits),
            }
    return cards
