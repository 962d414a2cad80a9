"""Decode's event-loop side of the handoff: send tickets to prefill, carry replies back.

The engine thread decides (``DecodeEngineCore``); this driver only moves messages:

1. ``SendHandoff`` notice -> a task sends the PrefillRequest over the ``PrefillChannel`` and waits
   at most the lease (+ grace) for the reply.
2. A readable PrefillResult -> ``core.complete`` on the engine thread. A timeout -> ``core.lost``
   with ``HandoffTimedOut``; an unreachable prefill, a mismatched protocol version or an
   unreadable reply -> ``core.lost`` with that typed error (the pages drain: writes may exist).
3. ``SendAbort`` notice -> an AbortRequest; ``AbortAck(quiesced=True)`` -> ``core.drained``.
   Without a quiescence ack the core's drain deadline releases the pages.

No wait is unbounded: every channel call has a timeout, and the core has deadlines of its own.
Each prefill call runs inside ``traced(request_id, tenant)`` (a no-op unless tracing is on: see
``backend.server.tracing.HandoffTraces``), so the call carries the request's trace context.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

from backend.core.errors import KvguardError
from backend.disagg.decode_core import DecodeEngineCore, HandoffTicket, Notice, SendAbort
from backend.disagg.errors import HandoffTimedOut, PrefillUnavailable
from backend.disagg.protocol import (
    AbortAck,
    AbortRequest,
    PrefillRequest,
    PrefillResult,
    TransferTarget,
)
from backend.engine.async_engine import AsyncEngine

log = logging.getLogger("kvguard.disagg.decode")
Traced = Callable[[str, str], AbstractContextManager[None]]


def _untraced(request_id: str, tenant: str) -> AbstractContextManager[None]:
    return nullcontext()


class PrefillChannel(Protocol):
    """How decode reaches prefill's two handoff endpoints (HTTP in production)."""

    async def prefill(self, message: PrefillRequest, timeout_s: float) -> PrefillResult: ...

    async def abort(self, message: AbortRequest, timeout_s: float) -> AbortAck: ...


class HandoffDriver:
    def __init__(
        self,
        *,
        engine: AsyncEngine,
        core: DecodeEngineCore,
        channel: PrefillChannel,
        target: TransferTarget,
        abort_timeout_s: float,
    ) -> None:
        self._engine = engine
        self._core = core
        self._channel = channel
        self._target = target
        self._abort_timeout_s = abort_timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        self.traced: Traced = _untraced  # set by the app when it exports spans

    def notify_from_engine(self, notice: Notice) -> None:
        """Called on the engine thread: hop to the event loop."""
        self._engine.call_soon_on_loop(lambda: self._on_notice(notice))

    def _on_notice(self, notice: Notice) -> None:
        if isinstance(notice, SendAbort):
            self._spawn(self._abort(notice.request_id, notice.handoff_id))
        else:
            self._spawn(self._send(notice.ticket))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _send(self, ticket: HandoffTicket) -> None:
        config = self._core.config
        message = PrefillRequest(
            config.protocol_version,
            ticket.handoff_id,
            ticket.tenant,
            ticket.prompt_ids,
            ticket.sampling,
            len(ticket.prompt_ids),
            ticket.grants,
            self._target,
            config.lease_s,
            ticket.seal_key,
        )
        rid, core = ticket.request_id, self._core
        try:
            with self.traced(rid, ticket.tenant):
                result = await self._channel.prefill(
                    message, config.lease_s + config.result_grace_s
                )
        except TimeoutError:
            error: KvguardError = HandoffTimedOut(rid, config.lease_s)
            self._engine.post(lambda: core.lost(rid, error))
        except KvguardError as exc:  # version mismatch, malformed reply, prefill unavailable
            typed = exc  # `exc` is unbound after the block; the posted call runs later
            self._engine.post(lambda: core.lost(rid, typed))
        except Exception as exc:  # a broken connection of any kind: prefill is lost
            lost = PrefillUnavailable(f"{type(exc).__name__} during the handoff")
            self._engine.post(lambda: core.lost(rid, lost))
        else:
            self._engine.post(lambda: core.complete(rid, result))

    async def _abort(self, request_id: str, handoff_id: str) -> None:
        config, core = self._core.config, self._core
        message = AbortRequest(config.protocol_version, handoff_id, config.instance_id)
        try:
            ack = await self._channel.abort(message, self._abort_timeout_s)
        except Exception as exc:  # unreachable prefill: the drain deadline releases the pages
            log.warning(
                "abort of %s not acknowledged (%s); pages wait for the drain bound",
                request_id,
                type(exc).__name__,
            )
            return
        if ack.quiesced and ack.request_id == handoff_id:
            self._engine.post(lambda: core.drained(request_id, "ack"))
        else:
            log.warning(
                "prefill did not confirm quiescence for %s (state %s)", request_id, ack.state
            )
