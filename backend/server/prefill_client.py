"""Decode's view of the prefill role: the HTTP channel, and prefill's capacity kept fresh.

``HttpPrefillChannel`` speaks the handoff messages over HTTP (``/kv/v1/prefill``,
``/kv/v1/abort``); every call has a timeout, and a reply from another protocol version is refused
(``ProtocolVersionMismatch``) before anything else in it is read.

``PrefillMonitor`` polls prefill's ``/engine/capacity`` every ``refresh_s``, announcing decode's
exact transfer target with each read (``/kv/v1/decode``: prefill writes nowhere else, and a
prefill that restarted learns it again within one refresh), and is decode's ``PathGuard``: it
fails closed (503 ``prefill_unavailable``) when prefill's capacity is unknown or it refuses the
announcement (or went away during it), when the capacity is
older than ``stale_s`` or incompatible (page size), refuses a prefill on another protocol version
(503 ``handoff_protocol_mismatch``), and admits a request against the smaller of decode's own
limits and prefill's real ones -- unless the ``legacy_reject_handoff`` drill is on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import ValidationError

from backend.core.admission import CapacityLimits, admit
from backend.core.errors import KvguardError
from backend.disagg.decode_driver import PrefillChannel
from backend.disagg.errors import PrefillUnavailable, ProtocolVersionMismatch
from backend.disagg.protocol import (
    AbortAck,
    AbortRequest,
    DecodeAnnouncement,
    PrefillRequest,
    PrefillResult,
    abort_ack_from_wire,
    decode_announcement_from_wire,
    prefill_result_from_wire,
    to_wire,
)
from backend.metrics import EngineMetrics
from contracts.capacity import path_max_request_tokens
from contracts.engine import CapacityReport, Role, RoleCapacity

log = logging.getLogger("kvguard.disagg.decode")


class PrefillLink(PrefillChannel, Protocol):
    """Everything decode asks the prefill role: the handoff messages, its capacity, and to
    record where decode may be written to."""

    async def capacity(self, timeout_s: float) -> CapacityReport: ...

    async def announce(self, message: DecodeAnnouncement, timeout_s: float) -> None: ...


PREFILL_PATH = "/kv/v1/prefill"
ABORT_PATH = "/kv/v1/abort"
ANNOUNCE_PATH = "/kv/v1/decode"
_PROPAGATOR = TraceContextTextMapPropagator()


class HttpPrefillChannel:
    def __init__(self, base_url: str, client: httpx.AsyncClient, *, local_version: int) -> None:
        self._base = base_url.rstrip("/")
        self._client = client
        self._version = local_version

    async def prefill(self, message: PrefillRequest, timeout_s: float) -> PrefillResult:
        payload = await self._post(PREFILL_PATH, to_wire(message), timeout_s)
        return prefill_result_from_wire(payload, self._version)

    async def abort(self, message: AbortRequest, timeout_s: float) -> AbortAck:
        payload = await self._post(ABORT_PATH, to_wire(message), timeout_s)
        return abort_ack_from_wire(payload, self._version)

    async def announce(self, message: DecodeAnnouncement, timeout_s: float) -> None:
        try:
            payload = await self._post(ANNOUNCE_PATH, to_wire(message), timeout_s)
        except TimeoutError as exc:
            raise PrefillUnavailable(f"{ANNOUNCE_PATH} took longer than {timeout_s:.1f} s") from exc
        except httpx.HTTPError as exc:  # prefill went away mid-exchange (a restart, a crash)
            raise PrefillUnavailable(f"{ANNOUNCE_PATH} failed ({type(exc).__name__})") from exc
        if decode_announcement_from_wire(payload, self._version) != message:
            raise PrefillUnavailable("prefill recorded another transfer target than announced")

    async def capacity(self, timeout_s: float) -> CapacityReport:
        try:
            response = await self._client.get(self._base + "/engine/capacity", timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise PrefillUnavailable(f"capacity not readable ({type(exc).__name__})") from exc
        if response.status_code != 200:
            raise PrefillUnavailable(f"capacity answered HTTP {response.status_code}")
        try:
            return CapacityReport.model_validate(response.json())
        except (ValidationError, ValueError) as exc:
            raise PrefillUnavailable("capacity report does not match the schema") from exc

    async def _post(self, path: str, body: dict[str, Any], timeout_s: float) -> object:
        headers: dict[str, str] = {}
        _PROPAGATOR.inject(headers)  # the handoff's span, when the driver traces this call
        try:
            response = await self._client.post(
                self._base + path, json=body, timeout=timeout_s, headers=headers
            )
        except httpx.TimeoutException as exc:
            raise TimeoutError(f"{path} took longer than {timeout_s:.1f} s") from exc
        # 409 carries the peer's protocol version: the codec turns it into a clear refusal.
        if response.status_code not in (200, 409):
            raise PrefillUnavailable(f"{path} answered HTTP {response.status_code}{_why(response)}")
        try:
            return response.json()
        except ValueError as exc:
            raise PrefillUnavailable(f"{path} answered something that is not JSON") from exc


def _why(response: httpx.Response) -> str:
    """``: <the error's message>`` of an OpenAI-style error body, if there is one."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return f": {message}" if isinstance(message, str) else ""


@dataclass(frozen=True, slots=True)
class _Seen:
    report: CapacityReport
    at: float


class PrefillMonitor:
    """Prefill's real capacity as decode last saw it, and the admission that depends on it."""

    def __init__(
        self,
        channel: PrefillLink,
        *,
        announcement: DecodeAnnouncement,
        own_limits: CapacityLimits,
        local_version: int,
        refresh_s: float,
        stale_s: float,
        cross_role_admission: bool,
        metrics: EngineMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._channel = channel
        self._announcement = announcement
        self._own = own_limits
        self._version = local_version
        self._refresh_s = refresh_s
        self._stale_s = stale_s
        self._cross_role = cross_role_admission
        self._metrics = metrics
        self._clock = clock
        self._seen: _Seen | None = None
        self._last_error = "prefill capacity not read yet"
        self._unannounced: str | None = "decode's transfer target is not announced yet"

    async def run(self) -> None:
        """Poll until cancelled: no failure of one refresh ends the polling, or decode would
        report a stale path for as long as it runs."""
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a bug: fail closed until a refresh succeeds
                log.exception("prefill monitor: the refresh failed")
                self._unannounced = f"the last refresh failed ({type(exc).__name__})"
            await asyncio.sleep(self._refresh_s)

    async def refresh(self) -> bool:
        timeout_s = min(self._refresh_s * 2, self._stale_s)
        try:
            report = await self._channel.capacity(timeout_s)
        except PrefillUnavailable as exc:
            return self._failed(exc.problem)
        self._seen = _Seen(report, self._clock())
        self._metrics.prefill_capacity_age.set(0)
        if report.protocol_version != self._version:
            return True  # nothing to announce to it: ``_require`` refuses the version
        try:
            await self._channel.announce(self._announcement, timeout_s)
        except PrefillUnavailable as exc:
            self._unannounced = f"it does not take decode's transfer target: {exc.problem}"
            return self._failed(self._unannounced)
        except KvguardError as exc:  # another protocol version, a malformed echo
            self._unannounced = str(exc)
            return self._failed(self._unannounced)
        self._unannounced = None
        return True

    def _failed(self, problem: str) -> bool:
        if self._last_error != problem:
            log.warning("prefill capacity or announcement: %s", problem)
        self._last_error = problem
        return False

    # -- PathGuard -------------------------------------------------------------------------------

    def admit(self, prompt_tokens: int, max_tokens: int) -> None:
        report = self._require()
        if not self._cross_role:
            return  # the legacy_reject_handoff drill: decode's own pool only
        prefill = CapacityLimits(report.page_size, report.pool_pages, report.context_window)
        roles = (prefill, self._own)
        limit = path_max_request_tokens(self._own.context_window, roles)
        # the role that sets the limit: its pool and window are what a refusal states
        admit(prompt_tokens, max_tokens, next(r for r in roles if r.max_request_tokens == limit))

    def peer_roles(self) -> list[RoleCapacity]:
        if self._seen is None:
            return []
        report, age = self._seen.report, self._clock() - self._seen.at
        self._metrics.prefill_capacity_age.set(age)
        own = next((r for r in report.roles if r.role is Role.PREFILL), None)
        base = own.model_dump() if own is not None else _role_from_report(report)
        return [RoleCapacity(**{**base, "age_s": round(age, 3)})]

    def unavailable(self) -> str | None:
        try:
            self._require()
        except (PrefillUnavailable, ProtocolVersionMismatch) as exc:
            return str(exc)
        return None

    def _require(self) -> CapacityReport:
        if self._seen is None:
            raise PrefillUnavailable(self._last_error)
        age = self._clock() - self._seen.at
        if age > self._stale_s:
            raise PrefillUnavailable(
                f"its capacity is {age:.1f} s old (stale after {self._stale_s:.1f} s): "
                f"{self._last_error}"
            )
        report = self._seen.report
        if report.protocol_version != self._version:
            raise ProtocolVersionMismatch(self._version, report.protocol_version, "prefill role")
        if report.role is not Role.PREFILL or report.page_size != self._own.page_size:
            raise PrefillUnavailable(
                f"the peer is a {report.role.value} role with {report.page_size}-token pages; "
                f"decode needs a prefill role with {self._own.page_size}-token pages"
            )
        if self._unannounced is not None:
            raise PrefillUnavailable(self._unannounced)
        return report


def _role_from_report(report: CapacityReport) -> dict[str, Any]:
    return {
        "role": report.role,
        "page_size": report.page_size,
        "pool_pages": report.pool_pages,
        "pool_tokens": report.pool_tokens,
        "free_pages": report.free_pages,
        "quarantined_pages": report.quarantined_pages,
        "context_window": report.context_window,
        "max_request_tokens": report.max_request_tokens,
        "protocol_version": report.protocol_version,
        "drift": report.drift,
        "faults": report.faults,
    }
