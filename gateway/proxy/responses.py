"""``POST /v1/responses`` on the data plane: the Responses API through the same ``Flight`` as chat.

``serve_response`` runs one request in a ``ResponsesFlight`` -- chat's flight
(``gateway.proxy.service``: admit, forward, relay, one exit in ``finish``) with these steps of its
own, in order:

1. the tenant's stored conversation when ``previous_response_id`` is set
   (``gateway.services.responses.history``: one statement scoped to the tenant; another tenant's
   id is a 404 exactly like an id never issued);
2. the request as a chat completion (``gateway.responses.to_chat``): what admission routes, counts,
   fits, limits and hands to the request hooks (the canary's marker goes into its first system
   message), on the engines whose kind serves every Responses field the request uses
   (``gateway.responses.surface``; none: its 400 naming the field). A native engine also reads
   the ``reasoning`` items the chat form leaves out: when one may serve a conversation that holds
   them, the chat form is that of the conversation as it reads it, each reasoning item an
   assistant message of its text (``passthrough.reasoning_as_messages``), so that text is counted,
   limited and screened too, and only native engines serve the request;
3. forward: to a *translated* engine (the bundled one, a declared OpenAI-compatible server, a
   litellm provider) that chat completion; to a *native* one (vLLM, SGLang) its own
   ``/v1/responses`` body (``gateway.responses.passthrough``: the whole conversation, ``store``
   false, never the client's ``previous_response_id`` or ``conversation``), whose ``instructions``
   start with the line the hooks put first in the chat form (``_hooked_instructions``);
4. the answer through the Responses machine of that engine (``ChatToResponses`` or
   ``NativeStream``), which screens every model-written string with the request's guards: a
   stream event by event through the pump (``ResponsesRelay``), a whole answer at once; a cut is
   an ``error`` event and a ``response.failed`` naming the isolation code (a whole answer: chat's
   error response), never a truncated "completed";
5. once the answer completed (or is incomplete at ``max_output_tokens``) and the client asked to
   store it (``store``, OpenAI's default), the Response and its conversation are saved for the
   tenant before the last bytes leave (a client that read ``response.completed`` can retrieve
   it); the flight's ``finally`` then audits the request (content-free) as it does chat's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker
from starlette.responses import Response

from contracts.engine import HandoffProof, handoff_of
from contracts.plugins import Cut
from contracts.sql import DATABASE_ERRORS, is_outage, run_in_session, utcnow
from contracts.sse import DONE, parse_event
from gateway.domain import Principal
from gateway.engines.isolation import isolate
from gateway.engines.registry import EngineRecord
from gateway.errors import (
    DatabaseDown,
    GatewayError,
    HandoffMismatch,
    InvalidRequest,
    NoHealthyEngine,
    UpstreamFailed,
)
from gateway.lifecycle import Phase
from gateway.openai.schemas import ChatCompletionBody
from gateway.openai.surface import profile_of
from gateway.proxy import latency
from gateway.proxy.admission import Admitted, ParamNames, admit, route
from gateway.proxy.body import off_loop
from gateway.proxy.context import RequestContext, open_request
from gateway.proxy.deps import ProxyDeps
from gateway.proxy.ending import COMPLETED, Answer, Outcome
from gateway.proxy.reply import AsgiReply
from gateway.proxy.service import Flight
from gateway.proxy.stream import RelayedStream, StreamPump
from gateway.responses import items, objects, passthrough, to_chat
from gateway.responses import surface as responses_surface
from gateway.responses.chat_stream import ChatToResponses
from gateway.responses.events import Step
from gateway.responses.native import NativeStream
from gateway.responses.schemas import CreateResponseBody
from gateway.services import responses as store
from gateway.upstream.base import Endpoint, UpstreamCall

log = logging.getLogger("kvguard.gateway.proxy")

Machine = ChatToResponses | NativeStream
T = TypeVar("T")
INVALID = "the engine sent an invalid event"
TOO_LARGE = "the engine sent an event past the size limit"


async def serve_response(
    deps: ProxyDeps,
    *,
    reply: AsgiReply,
    principal: Principal,
    body: CreateResponseBody,
    request_id: str,
    incoming_headers: Mapping[str, str],
    sessions: sessionmaker[Session],
    retention: timedelta,
) -> None:
    ctx = open_request(
        deps.tracing,
        request_id=request_id,
        principal=principal,
        endpoint=Endpoint.RESPONSES,
        model=body.model,
        stream=body.stream,
        incoming_headers=incoming_headers,
    )
    flight = ResponsesFlight(deps, ctx, body, reply, sessions=sessions, retention=retention)
    await flight.run()


class ResponsesFlight(Flight):
    """One Responses request: chat's flight, with the stored conversation, the Responses machine
    of the chosen engine, and the save at the end."""

    def __init__(
        self,
        deps: ProxyDeps,
        ctx: RequestContext,
        request: CreateResponseBody,
        reply: AsgiReply,
        *,
        sessions: sessionmaker[Session],
        retention: timedelta,
    ) -> None:
        self.request = request
        self._sessions = sessions
        self._retention = retention
        self._history: list[dict[str, Any]] = []
        self._machine: Machine | None = None
        self._fields = responses_surface.requested(request)
        self._native_only = False  # set by ``_serve``
        super().__init__(deps, ctx, _placeholder(request), reply)

    # -- admission and forwarding ---------------------------------------------------------------

    async def _serve(self) -> Outcome:
        request = self.request
        # an unknown model or field before any SQL
        routable = route(self.deps, self.ctx.model, self._narrow)
        if request.previous_response_id is not None:
            self._history = await self._stored_history(request.previous_response_id)
        # A native engine reads the reasoning items that the chat form leaves out: when one may
        # serve a conversation that holds them, admission counts, fits, limits and screens the
        # conversation as that engine reads it, and only native engines serve it (``_narrow``; a
        # translated one would be sent that form).
        read = None
        if any(responses_surface.native(record) for record in routable):
            read = passthrough.reasoning_as_messages(request, self._history)
        self._native_only = read is not None
        chat = _chat_form(*(read or (request, self._history)))
        self.body = chat
        sized_by = "max_output_tokens" if request.max_output_tokens is not None else None
        names = ParamNames("input", sized_by)
        admitted = await admit(self.deps, self.ctx, chat, narrow=self._narrow, names=names)
        native = responses_surface.native(admitted.engine)
        call = self._forward(admitted, Endpoint.RESPONSES if native else Endpoint.CHAT)
        if native:
            call = dataclasses.replace(call, body=self._native_body(admitted, chat))
        self._machine = self._new_machine(native=native, max_output_tokens=admitted.size.max_tokens)
        if request.stream:
            return await self._stream(call, wants_usage=True)
        return await self._answer(call)

    def _narrow(self, records: list[EngineRecord]) -> list[EngineRecord]:
        """The engines whose kind serves every Responses field this request uses (only native
        ones once the chat form holds the conversation's reasoning items: ``_serve``)."""
        taking, first = [], None
        for record in records:
            refusal = responses_surface.refusal(self._fields, record)
            if refusal is None:
                taking.append(record)
            elif first is None:
                first = refusal
        if not taking:
            assert first is not None
            raise first
        if self._native_only:
            taking = [record for record in taking if responses_surface.native(record)]
            if not taking:
                raise NoHealthyEngine(
                    f"no healthy engine for model '{self.ctx.model}' that reads reasoning items"
                )
        return taking

    async def _stored_history(self, response_id: str) -> list[dict[str, Any]]:
        tenant_id = self.ctx.principal.tenant_id
        return await _db(
            self._sessions,
            lambda session: store.history(
                session, tenant_id=tenant_id, response_id=response_id, now=utcnow()
            ),
        )

    def _native_body(self, admitted: Admitted, chat: ChatCompletionBody) -> dict[str, Any]:
        """The engine's own ``/v1/responses`` body, with what the hooks added to the chat form
        (the canary's marker line) first in its instructions, and the tenant's cache salt."""
        engine = admitted.engine
        body = passthrough.native_body(
            self.request,
            history=self._history,
            max_output_tokens=admitted.size.max_tokens,
            profile=profile_of(engine),
        )
        plain = chat.model_dump(exclude_unset=True)["messages"]
        instructions = _hooked_instructions(
            plain, admitted.body.get("messages", []), self.request.instructions
        )
        if instructions is not None:
            body["instructions"] = instructions
        return isolate(
            body,
            engine.snapshot,
            key=self.deps.settings.cache_salt,
            tenant_id=self.ctx.principal.tenant_id,
        )

    def _new_machine(self, *, native: bool, max_output_tokens: int) -> Machine:
        envelope = objects.envelope(
            self.request,
            response_id=objects.new_id("resp"),
            created_at=int(time.time()),
            max_output_tokens=max_output_tokens,
        )
        kind = NativeStream if native else ChatToResponses
        return kind(
            envelope,
            self.disclosure.open,  # not a method of the flight: no reference cycle
            hidden_prompt_tokens=self.ctx.hidden_prompt_tokens,
            stream=self.request.stream,
        )

    @property
    def machine(self) -> Machine:
        assert self._machine is not None, "the machine is made before the engine is called"
        return self._machine

    # -- replies ---------------------------------------------------------------------------------

    def _error(self, err: GatewayError) -> Response | bytes:
        """An error once the stream is open ends it as the Responses API does: an ``error`` event
        and a ``response.failed``."""
        if self._streaming and self._machine is not None:
            self._machine.mark()  # what was built before went out: a failure only adds
            return self._machine.fail(err.code, err.message).out
        return super()._error(err)

    # -- a whole answer --------------------------------------------------------------------------

    async def _answer(self, call: UpstreamCall) -> Outcome:
        reply = await self._call_engine(call)
        if reply.status != 200:
            return await self._engine_refused(reply)
        if reply.body is None:
            raise UpstreamFailed("invalid engine answer")
        ctx, machine = self.ctx, self.machine
        ctx.answered = True
        self._check_handoff(handoff_of(reply.body))
        body = reply.body
        step = await off_loop(len(reply.raw or ""), lambda: machine.whole_answer(body))
        self._note_counts(machine)
        if step.end is Phase.CUT and step.cut is not None:
            return await self._cut(step.cut)
        if step.end is not Phase.COMPLETED or machine.response is None:
            raise UpstreamFailed("the engine sent an invalid answer")
        await self._save(machine.response)
        ctx.first_byte_s = ctx.elapsed_s()
        latency.answered(self.deps, ctx)
        # the redaction count as a header (the published Response has no place for our object)
        headers = {**self._headers(), **self.disclosure.headers()}
        return Outcome(COMPLETED, Answer(machine.response, headers))

    # -- a stream --------------------------------------------------------------------------------

    def _stream_relay(self, *, wants_usage: bool) -> RelayedStream:
        return ResponsesRelay(
            self.machine,
            refuse_handoff_mismatch=self.deps.settings.refuse_on_handoff_mismatch,
        )

    async def _stream_ended(self, relay: RelayedStream, pump: StreamPump) -> Outcome:
        outcome = await super()._stream_ended(relay, pump)
        response = self.machine.response
        if outcome.ending is not COMPLETED or response is None:
            return outcome
        try:
            await self._save(response)
        except GatewayError as err:  # kept nothing: the client must not get an id that is no one's
            log.warning("response of request %s not stored: %s", self.ctx.request_id, err.code)
            last, terminal = pump.last, self.machine.last_event  # completed (or incomplete)
            assert last.endswith(terminal), "the terminal event ends the stream's last bytes"
            failed = self.machine.fail_instead(err.code, err.message)
            return Outcome(
                dataclasses.replace(outcome.ending, phase=Phase.FAILED, status=err.status),
                last[: len(last) - len(terminal)] + failed.out,
            )
        return outcome

    # -- the tenant's state ----------------------------------------------------------------------

    async def _save(self, response: dict[str, Any]) -> None:
        """Keep the Response for the tenant when the client asked to (``store``)."""
        if not self.request.stores:
            return
        tenant_id, history = self.ctx.principal.tenant_id, self._history
        input_items = items.stored_input(self.request)
        retention = self._retention
        await _db(
            self._sessions,
            lambda session: store.save(
                session,
                tenant_id=tenant_id,
                response=response,
                history=history,
                input_items=input_items,
                now=utcnow(),
                retention=retention,
            ),
        )

    def _note_counts(self, machine: Machine) -> None:
        self.ctx.completion_tokens = machine.completion_tokens
        self.ctx.engine_prompt_tokens = machine.prompt_tokens


class ResponsesRelay:
    """The pump's relay for a Responses stream (``gateway.proxy.stream.EventRelay``): each
    upstream event through the request's machine -- a chat chunk through ``ChatToResponses``
    (``[DONE]`` ends it), an engine's own event through ``NativeStream`` -- with the response's
    first events (``response.created``, ``response.in_progress``) ahead of the first one for a
    translated stream. Pure: no I/O."""

    def __init__(self, machine: Machine, *, refuse_handoff_mismatch: bool = True) -> None:
        self.machine = machine
        self._refuse_mismatch = refuse_handoff_mismatch
        self._head = machine.start() if isinstance(machine, ChatToResponses) else b""
        self.end: Phase | None = None
        self.end_code: str | None = None
        self.cut: Cut | None = None
        self.handoff: HandoffProof | None = None
        self.finish_reasons: list[str] = []
        self.text_events = 0

    @property
    def completion_tokens(self) -> int | None:
        return self.machine.completion_tokens

    @property
    def prompt_tokens(self) -> int | None:
        return self.machine.prompt_tokens

    def relay_event(self, raw: bytes, out: list[bytes]) -> bool:
        machine = self.machine
        if isinstance(machine, NativeStream):
            return self._step(machine.on_event(raw), out)
        data, _ = parse_event(raw)
        if data is None:
            return False  # a keep-alive: the Responses stream has its own events
        if data.strip() == DONE:
            return self._step(machine.done(), out)
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):
            return self._fail("upstream_error", INVALID, out)
        if not isinstance(chunk, dict):
            return self._fail("upstream_error", INVALID, out)
        proof = handoff_of(chunk)
        if proof is not None:
            self.handoff = proof
            if not proof.consistent and self._refuse_mismatch:
                return self._fail(HandoffMismatch.code, HandoffMismatch.MESSAGE, out)
        return self._step(machine.feed(chunk), out)

    def relay_end(self, out: list[bytes]) -> None:
        self._step(self.machine.upstream_ended(), out)

    def invalid(self, out: list[bytes]) -> bool:
        return self._fail("upstream_error", TOO_LARGE, out)

    def _fail(self, code: str, message: str, out: list[bytes]) -> bool:
        self.machine.mark()  # a failure between the machine's own events only adds
        return self._step(self.machine.fail(code, message), out)

    def _step(self, step: Step, out: list[bytes]) -> bool:
        if self._head:
            out.append(self._head)
            self._head = b""
        if step.out:
            out.append(step.out)
            if b".delta\n" in step.out:
                self.text_events += 1
        if step.end is None:
            return False
        self.end, self.end_code, self.cut = step.end, step.code, step.cut
        return True


def _hooked_instructions(
    plain: list[dict[str, Any]], hooked: list[dict[str, Any]], instructions: str | None
) -> str | None:
    """The instructions a native engine gets so that it reads what the request hooks added to the
    chat form (``canary.injection.inject_chat``: a line first in the first system message, or a
    system message of its own first): that line, then the client's instructions. None: the hooks
    changed nothing (or the addition was dropped to fit)."""
    if hooked == plain:
        return None
    first = hooked[0] if hooked else {}
    content = first.get("content")
    if first.get("role") != "system" or not isinstance(content, str):
        raise GatewayError("a request hook's change has no form in the Responses API")
    if hooked[1:] == plain:  # a system message of its own
        line = content
    elif len(hooked) == len(plain) and hooked[1:] == plain[1:] and plain[0].get("role") == "system":
        original = str(plain[0].get("content") or "")
        if not content.endswith("\n" + original):
            raise GatewayError("a request hook's change has no form in the Responses API")
        line = content[: len(content) - len(original) - 1]
    else:
        raise GatewayError("a request hook's change has no form in the Responses API")
    return f"{line}\n{instructions}" if instructions else line


def _placeholder(request: CreateResponseBody) -> ChatCompletionBody:
    """The flight's chat body before the conversation is read (only its model and stream are
    read until ``_serve`` sets the real one)."""
    return ChatCompletionBody.model_construct(model=request.model, stream=request.stream)


def _chat_form(request: CreateResponseBody, history: list[dict[str, Any]]) -> ChatCompletionBody:
    try:
        return to_chat.chat_body(request, history)
    except to_chat.UnreadableHistory as exc:
        message = f"the stored conversation cannot be continued: {exc}"
        raise InvalidRequest(message, param="previous_response_id") from exc
    except ValueError as exc:  # pydantic's ValidationError is one too
        raise InvalidRequest(_first_error(exc), param="input") from exc


def _first_error(exc: ValueError) -> str:
    if isinstance(exc, ValidationError):
        errors = exc.errors()
        message = str(errors[0].get("msg", "invalid input")) if errors else "invalid input"
    else:
        message = str(exc) or "invalid input"
    return f"the conversation cannot be sent as a chat: {message}"


async def _db(sessions: sessionmaker[Session], work: Callable[[Session], T]) -> T:
    try:
        return await run_in_session(sessions, work)
    except DATABASE_ERRORS as exc:
        if not is_outage(exc):
            raise
        log.warning("database unavailable on /v1/responses: %s", type(exc).__name__)
        raise DatabaseDown("The gateway's database is unavailable; retry later.") from exc
