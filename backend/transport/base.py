"""The transport interface the handoff uses: register memory, write batches one-sided.

Lifecycle of a transport in one process: ``open`` (in the role's start-up) -> ``register`` every
memory region peers may write into or that writes are sent from -> ``write`` batches (prefill) ->
``close`` at shutdown. ``write`` is synchronous: when it returns, every byte of the batch has
landed in the peer's memory; when it raises ``TransferError``, any part of the batch may or may not
have landed (the handoff treats the pages as possibly written).

A transport knows addresses and lengths only: ownership and generations are checked by the
handoff on both sides, never by the transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Segment:
    """Copy ``length`` bytes from local address ``src`` to the peer's address ``dst``."""

    src: int
    dst: int
    length: int

    def __post_init__(self) -> None:
        if self.src <= 0 or self.dst <= 0 or self.length <= 0:
            raise ValueError(f"bad segment {self}")


class TransferError(RuntimeError):
    """A batch did not complete; some of its bytes may have landed."""


class TransportUnavailable(RuntimeError):
    """The configured transport cannot be used in this process (say why and what to do)."""


class KvTransport(ABC):
    name: str = "abstract"

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """Where peers reach this process's registered memory (``host:port`` or a name)."""

    @abstractmethod
    def register(self, address: int, length: int) -> None:
        """Allow peers to write into (and this process to send from) ``[address, +length)``."""

    @abstractmethod
    def write(self, endpoint: str, segments: Sequence[Segment]) -> None:
        """Write one batch into the peer at ``endpoint``; returns once all of it landed."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release the transport's resources."""
