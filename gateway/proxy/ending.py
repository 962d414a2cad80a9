"""How a tenant request ends, as a value: every ending the gateway knows is produced here.

An ``Ending`` is the terminal phase (``gateway.lifecycle.Phase``), the status and code the audit
row, metrics and span record, and what the tenant's token budget gets back. The request path
(``gateway.proxy.service``) turns whatever happened into one ``Outcome`` -- an ending and the
reply still to send -- and ``gateway.proxy.finish`` applies the ending once, in one place.

The endings:

- ``COMPLETED``: the engine's answer was delivered (a whole answer, or a stream to ``[DONE]``);
- ``refused(err, ...)``: a phase refused with an OpenAI-style error -- a client mistake or a limit
  (REJECTED, 4xx) or a failure on the path (FAILED, 5xx); all the unused budget comes back when
  the engine did no work for the request (it never answered);
- ``cut(cut)``: a response guard stopped the answer (CUT);
- ``stream_ended(...)``: how a relayed stream ended (COMPLETED, CUT, FAILED);
- ``CLIENT_GONE``: the client went away, or the request was cancelled (CANCELLED, 499);
- ``INTERNAL``: a bug in the gateway or one of its plug-ins (FAILED, 500; logged with a trace).

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from starlette.responses import Response

from contracts.plugins import Cut
from gateway.errors import GatewayError
from gateway.lifecycle import Phase


class Refund(StrEnum):
    UNUSED = "unused"  # what the answer did not use (max_tokens - completion); none if unknown
    ALL = "all"  # the engine did no work for this request


@dataclass(frozen=True, slots=True)
class Ending:
    phase: Phase
    status: int
    code: str | None = None
    refund: Refund = Refund.UNUSED


COMPLETED = Ending(Phase.COMPLETED, 200)
CLIENT_GONE = Ending(Phase.CANCELLED, 499, "client_disconnected")
INTERNAL = Ending(Phase.FAILED, 500, "internal_error")


def refused(err: GatewayError, *, engine_answered: bool) -> Ending:
    phase = Phase.REJECTED if err.status < 500 else Phase.FAILED
    refund = Refund.UNUSED if engine_answered else Refund.ALL
    return Ending(phase, err.status, err.code, refund)


def cut(verdict: Cut) -> Ending:
    return Ending(Phase.CUT, verdict.status, verdict.code)


def stream_ended(phase: Phase, code: str | None, verdict: Cut | None) -> Ending:
    """A relayed stream's end (``StreamRelay``'s step): 200 only when it completed."""
    if phase is Phase.COMPLETED:
        return COMPLETED
    return Ending(phase, verdict.status if verdict is not None else 502, code)


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole completion to send as JSON (200), with the gateway's own headers."""

    body: dict[str, Any] = field(repr=False)
    headers: dict[str, str]


Reply = Response | Answer | bytes | None
"""What is still to be sent once the request has finished: a whole response or answer (nothing
was sent yet), the last bytes of a stream that is already open (then the body ends), or nothing
(the client is gone)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    ending: Ending
    reply: Reply = None
