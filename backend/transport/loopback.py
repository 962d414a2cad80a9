"""A single-host fallback transport over TCP on a loopback address, for when Mooncake is not
installed or prefill and decode share one host.

Lifecycle: the receiving process (decode) listens on ``host`` (a loopback address, the one the
deployment names: ``KVGUARD_TRANSFER_BIND``, by default the address the role serves on) from its
first ``register``; a sender connects per batch and sends ``count`` then, per segment, ``(dst,
length, bytes)``; the receiver checks every destination against its registered memory (as
Mooncake's server does), copies under the same lock ``unregister`` takes (so once a region is
withdrawn nothing more lands in it), and acknowledges the batch with one status byte only after
every byte landed. ``write`` returns on that acknowledgement, so it has the same meaning as
Mooncake's synchronous write. The protocol has no read, and no authentication: every local user
can write into registered memory, which is why only a handoff's sealed landing region ever is.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import socket
import struct
import threading
import time
from collections.abc import Sequence

from backend.transport.base import KvTransport, Segment, TransferError, TransportUnavailable

log = logging.getLogger("kvguard.transport")

_HEADER = struct.Struct("!I")
_SEGMENT = struct.Struct("!QQ")
_OK, _REFUSED = b"\x00", b"\x01"
_MAX_SEGMENTS = 1 << 20
ACCEPT_RETRY_S = 0.05  # after a failed accept (out of descriptors): let the process recover


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed mid-batch")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class LoopbackTransport(KvTransport):
    name = "loopback"

    def __init__(self, *, host: str = "127.0.0.1", timeout_s: float = 30.0) -> None:
        if not is_loopback(host):
            raise TransportUnavailable(
                f"the loopback transport is single-host: it listens on a loopback address, not "
                f"{host!r} (set KVGUARD_TRANSFER_BIND=127.0.0.1, or use KVGUARD_TRANSPORT=mooncake "
                "between hosts)"
            )
        self._host = host.strip("[]")
        self._regions: dict[int, int] = {}  # address -> length
        self._lock = threading.Lock()
        self._timeout_s = timeout_s
        self._server: socket.socket | None = None
        self._endpoint = ""

    @property
    def endpoint(self) -> str:
        self._listen()
        return self._endpoint

    def register(self, address: int, length: int) -> None:
        with self._lock:
            self._regions[address] = length
        self._listen()

    def unregister(self, address: int) -> None:
        with self._lock:
            self._regions.pop(address, None)

    def write(self, endpoint: str, segments: Sequence[Segment]) -> None:
        host, _, port = endpoint.rpartition(":")
        if not is_loopback(host):
            raise TransferError(f"the loopback transport only writes to this host, not {host}")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), self._timeout_s) as conn:
                conn.sendall(_HEADER.pack(len(segments)))
                for segment in segments:
                    conn.sendall(_SEGMENT.pack(segment.dst, segment.length))
                    conn.sendall(ctypes.string_at(segment.src, segment.length))
                status = _read_exactly(conn, 1)
        except OSError as exc:
            raise TransferError(f"loopback write to {endpoint} failed: {exc}") from exc
        if status != _OK:
            raise TransferError(f"{endpoint} refused the batch (destination not registered)")

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    # -- receiving side ----------------------------------------------------------------------------

    def _listen(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
            server = socket.create_server((self._host, 0), family=family)
            self._server = server
            self._endpoint = f"{self._host}:{server.getsockname()[1]}"
        log.info("loopback transfer port listening at %s", self._endpoint)
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        """Until the port is closed: a failed accept of an open port (out of descriptors or
        buffers for a moment, a connection reset before it was taken) is logged and retried,
        or the port would go on taking connections that nothing reads."""
        while True:
            try:
                conn, _ = server.accept()
            except OSError as exc:
                if server.fileno() < 0:  # closed
                    return
                log.warning("loopback transfer port: accept failed (%s); retrying", exc)
                time.sleep(ACCEPT_RETRY_S)
                continue
            try:
                threading.Thread(target=self._receive, args=(conn,), daemon=True).start()
            except RuntimeError as exc:  # no thread to be had: this batch is refused
                log.warning("loopback transfer port: no thread for a connection (%s)", exc)
                conn.close()

    def _receive(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(self._timeout_s)
                (count,) = _HEADER.unpack(_read_exactly(conn, _HEADER.size))
                ok = count <= _MAX_SEGMENTS
                for _ in range(count if ok else 0):
                    dst, length = _SEGMENT.unpack(_read_exactly(conn, _SEGMENT.size))
                    data = _read_exactly(conn, length)
                    # after one refused segment, nothing else of the batch is written
                    ok = ok and self._land(dst, data)
                conn.sendall(_OK if ok else _REFUSED)
            except (OSError, ConnectionError) as exc:
                log.warning("loopback transfer broke off: %s", exc)

    def _land(self, address: int, data: bytes) -> bool:
        with self._lock:
            if not any(
                base <= address and address + len(data) <= base + size
                for base, size in self._regions.items()
            ):
                return False
            ctypes.memmove(address, data, len(data))
            return True
