"""Typed errors of the engine core, each with a stable ``code`` and the HTTP status it maps to.

Their base, ``KvguardError``, and the lifecycle refusal ``InvalidTransition`` are contracts every
package shares (``contracts.errors``, ``contracts.lifecycle``); they are named here too so the
engine's whole catalogue reads from one module.

The HTTP edge turns any :class:`KvguardError` into an OpenAI-style error body using ``code`` and
``http_status`` (see ``backend/server/errors.py``); logs, metrics and audit records use ``code``
and :meth:`KvguardError.details` as low-cardinality labels and structured fields. Messages and
details carry ids and counts only, never prompt or completion content, and never the identity of
another request or tenant (an isolation error names the page, not who holds it now).

Every error pickles by its constructor arguments, so a prefill process can report one to a decode
process (or a worker to the engine loop) without losing its type.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from contracts.errors import KvguardError
from contracts.lifecycle import InvalidTransition

__all__ = [
    "ContextLengthExceeded",
    "DuplicateRequestId",
    "InvalidRequest",
    "InvalidTransition",
    "InvariantViolation",
    "IsolationError",
    "IsolationReason",
    "KvguardError",
    "LimitReason",
    "OutOfPages",
    "StepProtocolError",
]


class LimitReason(StrEnum):
    """Which capacity bounds ``max_request_tokens`` (a metric label, so a closed set)."""

    CONTEXT_WINDOW = "context_window"
    KV_POOL = "kv_pool"


class ContextLengthExceeded(KvguardError):
    """prompt + max_tokens is larger than this engine can ever hold; raised before any page."""

    code = "context_length_exceeded"
    http_status = 400

    def __init__(
        self,
        limit: int,
        requested: int,
        prompt_tokens: int,
        max_tokens: int,
        reason: str,
        pool_tokens: int | None = None,
        context_window: int | None = None,
    ) -> None:
        self.limit = limit
        self.requested = requested
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.reason = reason
        self.pool_tokens = pool_tokens
        self.context_window = context_window
        if pool_tokens is not None and context_window is not None:
            bound = f"real KV pool: {pool_tokens}, context window: {context_window}"
        else:
            bound = f"bounded by {reason}"
        message = (
            f"This engine's maximum request length is {limit} tokens ({bound}); the request "
            f"needs {requested} tokens ({prompt_tokens} prompt + {max_tokens} max_tokens)"
        )
        args = (limit, requested, prompt_tokens, max_tokens, reason, pool_tokens, context_window)
        super().__init__(message, *args)

    def details(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "limit": self.limit,
            "requested": self.requested,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "reason": str(self.reason),
            "pool_tokens": self.pool_tokens,
            "context_window": self.context_window,
        }


class InvalidRequest(KvguardError):
    """A request the engine can never serve as sent (empty prompt, max_tokens < 1, ...)."""

    code = "invalid_request"
    http_status = 400

    def __init__(self, param: str, problem: str) -> None:
        self.param = param
        self.problem = problem
        super().__init__(f"{param}: {problem}", param, problem)

    def details(self) -> dict[str, Any]:
        return {"code": self.code, "param": self.param}


class DuplicateRequestId(KvguardError):
    """A live request already uses this id; ids key sampled tokens, so they must be unique."""

    code = "duplicate_request_id"
    http_status = 409

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"request id {request_id!r} is already in use", request_id)

    def details(self) -> dict[str, Any]:
        return {"code": self.code, "request_id": self.request_id}


class IsolationReason(StrEnum):
    """Why a page reference does not prove current ownership (a metric label)."""

    UNKNOWN_PAGE = "unknown_page"
    STALE_GENERATION = "stale_generation"
    WRONG_STATE = "wrong_page_state"
    OWNER_MISMATCH = "owner_mismatch"
    SCOPE_MISMATCH = "cache_scope_mismatch"  # a prefix-cache page of another namespace
    READ_ONLY = "read_only_page"  # a step would write a shared (prefix-cache) page


class IsolationError(KvguardError):
    """A page reference does not match the page's current generation, state or owner.

    Reading or writing through such a reference could touch another request's KV, so the
    operation is refused. Carries this request's id and the page's id and generations only.
    """

    code = "kv_isolation_violation"
    http_status = 500

    def __init__(
        self,
        request_id: str,
        page_id: int,
        expected_generation: int,
        actual_generation: int | None,
        reason: str,
    ) -> None:
        self.request_id = request_id
        self.page_id = page_id
        self.expected_generation = expected_generation
        self.actual_generation = actual_generation
        self.reason = reason
        message = (
            f"KV isolation check failed for request {request_id!r}: page {page_id} expected "
            f"generation {expected_generation}, found {actual_generation} ({reason})"
        )
        super().__init__(
            message, request_id, page_id, expected_generation, actual_generation, reason
        )

    def details(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "request_id": self.request_id,
            "page_id": self.page_id,
            "expected_generation": self.expected_generation,
            "actual_generation": self.actual_generation,
            "reason": str(self.reason),
        }


class OutOfPages(KvguardError):
    """Fewer free pages than asked for; nothing was allocated."""

    code = "kv_pool_exhausted"
    http_status = 503

    def __init__(self, requested: int, free: int) -> None:
        self.requested = requested
        self.free = free
        super().__init__(f"asked for {requested} KV pages, {free} free", requested, free)

    def details(self) -> dict[str, Any]:
        return {"code": self.code, "requested": self.requested, "free": self.free}


class StepProtocolError(KvguardError):
    """The runner broke the schedule -> run -> postprocess protocol (a bug, never a client's)."""

    code = "engine_step_protocol_violation"
    http_status = 500

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(problem, problem)


class InvariantViolation(KvguardError):
    """Bookkeeping disagrees with itself; the engine must stop serving rather than guess."""

    code = "internal_invariant_violation"
    http_status = 500

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(problem, problem)
