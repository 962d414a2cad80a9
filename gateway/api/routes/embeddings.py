"""``POST /v1/embeddings`` on FastAPI: the tenant's key (``CurrentTenant``), the body validated by
OpenAI's ``CreateEmbeddingRequest`` (400 naming the field), then ``gateway.proxy.embeddings``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.request_ids import request_id_of
from gateway.deps import CurrentTenant, StateDep
from gateway.openai.schemas import EmbeddingsBody
from gateway.proxy.embeddings import serve_embeddings

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/embeddings", response_model=None)
async def create_embeddings(
    body: EmbeddingsBody, principal: CurrentTenant, state: StateDep, request: Request
) -> Response:
    return await serve_embeddings(
        state.proxy,
        principal=principal,
        body=body,
        request_id=request_id_of(request),
        incoming_headers=request.headers,
    )
