"""OpenAI-compatible routes of the engine: completions, chat completions, models, tokenize."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from backend.core.errors import InvalidRequest, KvguardError
from backend.server import structured
from backend.server.generate import generate
from backend.server.openai_schema import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from backend.server.service import EngineService


def get_service(request: Request) -> EngineService:
    service: EngineService = request.app.state.service
    return service


ServiceDep = Annotated[EngineService, Depends(get_service)]
router = APIRouter()


class ModelNotFound(KvguardError):
    code = "model_not_found"
    http_status = 404

    def __init__(self, requested: str, served: str) -> None:
        super().__init__(
            f"model '{requested}' is not served here (this engine serves '{served}')",
            requested,
            served,
        )


def _check_model(service: EngineService, model: str | None) -> None:
    if model is not None and model != service.model_name:
        raise ModelNotFound(model, service.model_name)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: Request, service: ServiceDep) -> Response:
    _check_model(service, body.model)
    return await generate(service, http, body, body.prompt, "text")


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, http: Request, service: ServiceDep
) -> Response:
    _check_model(service, body.model)
    shape = structured.plan(body, service.tool_format)
    prompt = service.render_chat(body.messages, shape.tools)
    return await generate(service, http, body, prompt, "chat", shape)


def _model_card(service: EngineService) -> dict[str, Any]:
    return {
        "id": service.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "kvguard",
        "max_model_len": service.capacity().max_request_tokens,
    }


@router.get("/v1/models")
async def models(service: ServiceDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(service)]}


@router.get("/v1/models/{model:path}")
async def model(model: str, service: ServiceDep) -> dict[str, Any]:
    _check_model(service, model)
    return _model_card(service)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, service: ServiceDep) -> dict[str, Any]:
    _check_model(service, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("prompt", "give exactly one of 'prompt' or 'messages'")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
    if body.prompt is not None:
        text = body.prompt
    else:
        text = service.render_chat(body.messages or [], tools)
    tokens = service.encode_prompt(text, chat=body.messages is not None)
    return {
        "count": len(tokens),
        "tokens": tokens,
        "max_model_len": service.capacity().max_request_tokens,
    }
