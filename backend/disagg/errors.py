"""Typed errors of the prefill -> decode handoff, each with a stable ``code`` and HTTP status.

Like ``backend.core.errors``: messages carry ids, counts and versions only, never prompt or KV
content, and every error pickles by its constructor arguments.
"""

from __future__ import annotations

from typing import Any

from backend.core.errors import KvguardError


class ProtocolVersionMismatch(KvguardError):
    """The peer speaks another handoff protocol version: nothing is exchanged (fail closed)."""

    code = "handoff_protocol_mismatch"
    http_status = 503

    def __init__(self, local: int, remote: object, where: str) -> None:
        self.local = local
        self.remote = remote
        self.where = where
        super().__init__(
            f"handoff protocol mismatch ({where}): this node speaks version {local}, the peer "
            f"sent {remote!r}; mixed-version prefill/decode pairs are refused",
            local,
            remote,
            where,
        )

    def details(self) -> dict[str, Any]:
        return {"code": self.code, "local": self.local, "remote": str(self.remote)}


class MalformedMessage(KvguardError):
    """A handoff message that does not parse as this version's schema (refused, never guessed)."""

    code = "handoff_malformed_message"
    http_status = 502

    def __init__(self, message_type: str, problem: str) -> None:
        self.message_type = message_type
        self.problem = problem
        super().__init__(f"malformed {message_type}: {problem}", message_type, problem)


class HandoffRefused(KvguardError):
    """Decode refused the KV prefill handed over: a check found no positive evidence."""

    code = "kv_handoff_refused"
    http_status = 502

    def __init__(self, request_id: str, check: str, detail: str) -> None:
        self.request_id = request_id
        self.check = check
        self.detail = detail
        super().__init__(
            f"KV handoff for request {request_id!r} refused by the {check} check: {detail}",
            request_id,
            check,
            detail,
        )

    def details(self) -> dict[str, Any]:
        return {"code": self.code, "request_id": self.request_id, "check": self.check}


class HandoffFailed(KvguardError):
    """Prefill reported FAILED (or the transfer broke); no KV was accepted."""

    code = "kv_handoff_failed"
    http_status = 502

    def __init__(self, request_id: str, reason: str) -> None:
        self.request_id = request_id
        self.reason = reason
        message = f"KV handoff for request {request_id!r} failed: {reason}"
        super().__init__(message, request_id, reason)

    def details(self) -> dict[str, Any]:
        return {"code": self.code, "request_id": self.request_id}


class HandoffTimedOut(KvguardError):
    """No handoff result within the lease; the request fails and its pages drain."""

    code = "kv_handoff_timeout"
    http_status = 504

    def __init__(self, request_id: str, seconds: float) -> None:
        self.request_id = request_id
        self.seconds = seconds
        super().__init__(
            f"no KV handoff result for request {request_id!r} within {seconds:.1f} s",
            request_id,
            seconds,
        )


class PrefillUnavailable(KvguardError):
    """The prefill role cannot be reached, or its capacity is unknown or stale (fail closed)."""

    code = "prefill_unavailable"
    http_status = 503

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(f"the prefill role is unavailable: {problem}", problem)


class RemoteEngineError(KvguardError):
    """The peer's own typed error, passed through with its code, status and message.

    A prefill node's REJECTED reaches the client as exactly the error a unified engine gives.
    """

    def __init__(self, code: str, http_status: int, message: str) -> None:
        self.code = code
        self.http_status = http_status
        super().__init__(message, code, http_status, message)


class StagingUnavailable(KvguardError):
    """Prefill could not get staging memory for the transfer within the lease."""

    code = "kv_staging_unavailable"
    http_status = 503

    def __init__(self, pages: int, seconds: float) -> None:
        super().__init__(
            f"no {pages} staging pages for the KV transfer within {seconds:.1f} s", pages, seconds
        )
