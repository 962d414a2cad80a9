"""The Responses API's stored responses, the tenant's alone (``gateway.services.responses``):
``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``
and ``POST /v1/responses/{id}/cancel``. ``POST /v1/responses`` itself is the data plane's
(``gateway.proxy.responses``), declared in ``gateway.api.routes.openai``.

The key decides the tenant; no parameter can widen it. Every route validates its parameters
first, then runs the service's one lookup (``tenant_id = :t AND id = :id AND expires_at > :now``),
so an id of another tenant, an expired one, a deleted one and one never issued all answer the one
404 (``not_found``: the same status and body, built from the id the client sent, after the same
statement). Nothing here is audited: the audit stays content-free.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from contracts.sql import run_in_session, utcnow
from gateway.deps import CurrentTenant, StateDep
from gateway.domain import Principal
from gateway.errors import InvalidRequest
from gateway.responses import items
from gateway.services import responses as store
from gateway.state import GatewayState

router = APIRouter(prefix="/responses", tags=["openai"])  # under /v1 (routes.openai)

# ``include`` as OpenAI's SDKs send an array (``include[]=a``) and as others do (``include=a``)
Include = Annotated[list[str] | None, Query(alias="include[]")]
IncludeRepeated = Annotated[list[str] | None, Query(alias="include")]
NOT_STREAMED = "the gateway does not replay a stored response as a stream; omit 'stream'"
NO_INCLUDE = "the gateway stores no included outputs (logprobs, encrypted reasoning, tool results)"


@router.get("/{response_id}")
async def retrieve_response(
    response_id: str,
    principal: CurrentTenant,
    state: StateDep,
    stream: bool = False,
    include: Include = None,
    include_repeated: IncludeRepeated = None,
) -> dict[str, Any]:
    """The Response as its client got it."""
    _plain(stream=stream, include=[*(include or ()), *(include_repeated or ())])
    return (await _stored(state, principal, response_id)).response


@router.delete("/{response_id}")
async def delete_response(
    response_id: str, principal: CurrentTenant, state: StateDep
) -> dict[str, Any]:
    tenant_id = principal.tenant_id
    deleted = await run_in_session(
        state.sessions,
        lambda session: store.delete(
            session, tenant_id=tenant_id, response_id=response_id, now=utcnow()
        ),
    )
    if not deleted:
        raise store.not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    principal: CurrentTenant,
    state: StateDep,
    limit: Annotated[int, Query(ge=1, le=items.MAX_PAGE)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: Annotated[str | None, Query(max_length=256)] = None,
    include: Include = None,
    include_repeated: IncludeRepeated = None,
) -> dict[str, Any]:
    """This turn's input items, one page of OpenAI's ``ResponseItemList``."""
    _plain(stream=False, include=[*(include or ()), *(include_repeated or ())])
    stored = await _stored(state, principal, response_id)
    return items.page(stored.input_items, limit=limit, after=after, order=order)


@router.post("/{response_id}/cancel")
async def cancel_response(
    response_id: str, principal: CurrentTenant, state: StateDep
) -> dict[str, Any]:
    """Only a background response can be cancelled; the gateway runs none, so a stored one is a
    400 (as vLLM and OpenAI answer for a synchronous response) and any other id the 404."""
    await _stored(state, principal, response_id)
    raise InvalidRequest("Cannot cancel a synchronous response.", param="response_id")


async def _stored(state: GatewayState, principal: Principal, response_id: str) -> store.Stored:
    """The tenant's stored response by id, or the one 404 (``not_found``) for every other id."""
    tenant_id = principal.tenant_id
    stored = await run_in_session(
        state.sessions,
        lambda session: store.get(
            session, tenant_id=tenant_id, response_id=response_id, now=utcnow()
        ),
    )
    if stored is None:
        raise store.not_found(response_id)
    return stored


def _plain(*, stream: bool, include: list[str] | None) -> None:
    if stream:
        raise InvalidRequest(NOT_STREAMED, param="stream")
    if include:
        raise InvalidRequest(NO_INCLUDE, param="include")
