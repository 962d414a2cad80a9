"""What both Responses machines (``chat_stream.ChatToResponses``, ``native.NativeStream``) share:
the ``Step`` the pump gets per upstream event, and ``EventWriter``, which numbers and encodes the
events of one response and ends it as failed.

Sequence numbers are the gateway's: 0, 1, 2... in the order events are sent. An upstream event
that ends in a failure drops the events it had built (``mark`` at its start; ``fail`` reuses their
numbers), so the numbers never leave a gap. With ``stream`` off nothing is encoded (a whole
answer: only ``response`` matters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contracts.plugins import Cut
from gateway.lifecycle import Phase
from gateway.responses.objects import Envelope, dumps, error_event, failure_error, sse


@dataclass(slots=True)
class Step:
    """What to send for one upstream event, and how the stream ended if it did here."""

    out: bytes
    end: Phase | None = None
    code: str | None = None
    cut: Cut | None = None  # for the guards' owner (``on_cut``)


class EventWriter:
    def __init__(self, envelope: Envelope, *, stream: bool) -> None:
        self._env = envelope
        self._stream = stream
        self._seq = 0
        self._mark = 0  # the sequence number the current upstream event started at
        self.last_event = b""  # the event encoded last (the terminal one, once ended)
        self.response: dict[str, Any] | None = None  # the final Response, once ended

    def mark(self) -> None:
        """An upstream event starts: a failure in it drops what it built."""
        self._mark = self._seq

    def fail(self, code: str, message: str) -> Step:
        """End as failed: an ``error`` event naming ``code`` and a ``response.failed``."""
        self._seq = self._mark
        out = self.emit("error", error_event(code, message, 0))
        self.response = self._env.response(
            status="failed", output=[], error=failure_error(code, message)
        )
        out += self.emit("response.failed", {"response": self.response})
        return Step(out, Phase.FAILED, code)

    def fail_instead(self, code: str, message: str) -> Step:
        """End as failed in place of the terminal event just built, which is not sent (its
        sequence number is the ``error`` event's; its bytes, ``last_event`` before this call, are
        the caller's to drop): a completed answer the gateway could not keep (``store``) when the
        client must not get an id that nothing holds."""
        self._mark = self._seq - 1 if self._stream else self._seq
        return self.fail(code, message)

    def cut(self, cut: Cut) -> Step:
        """End as cut by a guard (failed, naming the guard's code)."""
        step = self.fail(cut.code, cut.message)
        return Step(step.out, Phase.CUT, cut.code, cut)

    def emit(self, event_type: str, fields: dict[str, Any]) -> bytes:
        if not self._stream:
            return b""
        fields = {"type": event_type, **fields, "sequence_number": self._seq}
        self._seq += 1
        self.last_event = sse(event_type, dumps(fields))
        return self.last_event

    def emit_raw(self, event_type: str, head: str) -> bytes:
        """An event whose JSON text up to its sequence number is ``head`` (a hot-path delta)."""
        if not self._stream:
            return b""
        payload = f'{head},"sequence_number":{self._seq}}}'
        self._seq += 1
        self.last_event = sse(event_type, payload)
        return self.last_event
