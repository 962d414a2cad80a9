"""What a tenant is told about how its answer was made, and what it is never told.

- **The ``kvguard`` object** of an answer is the gateway's, never the engine's: a whole answer
  carries it, a stream carries it in its final chunk (just before ``[DONE]``: the usage chunk
  when the client asked for usage, else a chunk with no choices; the headers are gone by the time
  the count is known). It holds what a tenant needs and nothing of the path behind it:

  - ``request_id``: the id the gateway's log, the audit row and any finding file the answer under
    (also the ``x-kvguard-request-id`` header);
  - ``isolation``: the verdict on the engine's handoff proof (``Isolation``);
  - ``redactions``: how many marker-like pieces the leak firewall stripped from the answer
    (``StreamGuard.redactions``, summed over every guard the answer opened: its texts and its
    side fields). Every kind of candidate counts one, so the count tells nothing about which kind
    was stripped; an answer emptied by stripping says so instead of arriving blank. A whole
    answer also carries it as the ``x-kvguard-redactions`` header.

  The engine's own object (its role, the proof with the checks it ran and skipped) stays in the
  audit row and the log, by request id.
- **No internal address.** The gateway's own messages say "the engine", never which one; the
  messages an engine writes itself and the gateway relays (its 4xx, a stream's error event) have
  every address in them -- a URL, an IP address, a ``host:port`` -- replaced by ``INTERNAL``. The
  log keeps the engine's name and address with the request id.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from contracts.engine import EXTENSION, HandoffProof
from contracts.plugins import StreamGuard

REDACTIONS_HEADER = "x-kvguard-redactions"
INTERNAL = "<internal>"


class Isolation(StrEnum):
    """``isolation``: what the engine proved about the KV the answer was computed from."""

    VERIFIED = "handoff_verified"  # a prefill->decode handoff whose proof held
    NO_HANDOFF = "no_handoff"  # no handoff proof: a unified engine, or an engine that gives none
    MISMATCH = "handoff_mismatch"  # delivered only where the operator turned the refusal off


def isolation(proof: HandoffProof | None) -> Isolation:
    if proof is None:
        return Isolation.NO_HANDOFF
    return Isolation.VERIFIED if proof.consistent else Isolation.MISMATCH


@dataclass(slots=True)
class Disclosure:
    """One answer's ``kvguard`` object, built as the answer goes: ``open`` is the answer's guard
    factory (every guard it opens is remembered, so their redactions can be summed)."""

    request_id: str
    open_guard: Callable[[], StreamGuard] = field(repr=False)
    _guards: list[StreamGuard] = field(default_factory=list, repr=False)

    def open(self) -> StreamGuard:
        guard = self.open_guard()
        self._guards.append(guard)
        return guard

    def redactions(self) -> int:
        return sum(guard.redactions() for guard in self._guards)

    def extension(self, proof: HandoffProof | None) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "isolation": isolation(proof).value,
            "redactions": self.redactions(),
        }

    def headers(self) -> dict[str, str]:
        return {REDACTIONS_HEADER: str(self.redactions())}

    def on_answer(self, body: dict[str, Any], proof: HandoffProof | None) -> dict[str, Any]:
        """A whole answer with the gateway's object in place of the engine's (a copy)."""
        return {**without_engine_object(body), EXTENSION: self.extension(proof)}


def without_engine_object(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without the engine's ``kvguard`` object and its top-level ``handoff`` proof (the
    same object when it has neither)."""
    if EXTENSION not in obj and "handoff" not in obj:
        return obj
    return {k: v for k, v in obj.items() if k not in (EXTENSION, "handoff")}


_ADDRESS = re.compile(
    r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()]+"  # a URL
    r"|\[[0-9A-Fa-f:.]+\](?::\d{1,5})?"  # an IPv6 address in brackets
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"  # an IPv4 address
    r"|\b[A-Za-z0-9](?:[A-Za-z0-9_-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9_-]+)*:\d{1,5}\b"  # host:port
)


def without_addresses(text: str) -> str:
    """An engine's message with every address in it replaced by ``INTERNAL``."""
    return _ADDRESS.sub(INTERNAL, text)


def scrubbed(value: object) -> str | None:
    """A string an engine wrote, without addresses; None for anything else."""
    return without_addresses(value) if isinstance(value, str) else None
