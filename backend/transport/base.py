"""The transport interface the handoff uses: register memory for one handoff, write batches.

Lifecycle of a transport in one process: ``open`` (in the role's start-up) -> per handoff,
``register`` the memory peers may write into (decode: that handoff's landing slots; prefill, only
when ``registers_sources``: the ciphertext it sends from) -> ``write`` batches (prefill) ->
``unregister`` at the handoff's end, whatever the outcome -> ``close`` at shutdown. ``write`` is
synchronous: when it returns, every byte of the batch has landed in the peer's memory; when it
raises ``TransferError``, any part of the batch may or may not have landed (the handoff treats the
pages as possibly written).

What a peer of the transfer port can do is the transport's own protocol, not ours: Mooncake's
handshake lists every registered buffer to whoever asks and its data port reads and writes any of
them (``backend.transport.mooncake``). So nothing but a handoff's sealed landing region is ever
registered (``backend.disagg.channel``), and nothing a transport delivers is trusted before the
handoff's checks.

A transport knows addresses and lengths only: ownership, generations and the seal are checked by
the handoff on both sides, never by the transport.
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

    @property
    def registers_sources(self) -> bool:
        """Whether memory a write is sent from must be registered too (RDMA); TCP reads any."""
        return False

    @abstractmethod
    def register(self, address: int, length: int) -> None:
        """Allow peers to write into (and this process to send from) ``[address, +length)``."""

    @abstractmethod
    def unregister(self, address: int) -> None:
        """Withdraw the region registered at ``address``: no new transfer may touch it."""

    @abstractmethod
    def write(self, endpoint: str, segments: Sequence[Segment]) -> None:
        """Write one batch into the peer at ``endpoint``; returns once all of it landed."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release the transport's resources."""
