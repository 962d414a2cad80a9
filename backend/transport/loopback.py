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

What one peer of the port can cost decode is bounded, since any local user is one:
- a segment's header is checked before any of its bytes are read: a destination outside every
  registered region, or a length past the end of the region it starts in, is answered with the
  refusal and the connection closed at once (the rest of the batch is never read);
- a segment's bytes land through one buffer of ``READ_BUFFER`` bytes per connection, each piece
  checked and copied under the lock, so a connection holds at most that much memory;
- at most ``max_connections`` connections are served at once (one thread each); one more is
  answered with the refusal and closed at accept;
- a connection has ``timeout_s`` in total, however slowly its bytes come, then it is closed.
An honest batch (at most decode's transfer-batch pages, into slots registered for it) fits all
of these; a peer that holds every connection makes batches in flight fail, and nothing more.
"""

from __future__ import annotations

import contextlib
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
READ_BUFFER = 1 << 20  # bytes a connection holds at a time, however long its segments
# Prefill sends each handoff's batches from one worker thread of asyncio's default executor
# (at most 32), one connection at a time: 32 slots take every honest sender at once.
MAX_CONNECTIONS = 32
ACCEPT_RETRY_S = 0.05  # after a failed accept (out of descriptors): let the process recover


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _fill(conn: socket.socket, view: memoryview, deadline: float) -> None:
    """Read exactly ``len(view)`` bytes into ``view`` before the connection's ``deadline``."""
    got = 0
    while got < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the connection's deadline passed")
        conn.settimeout(left)
        n = conn.recv_into(view[got:])
        if not n:
            raise ConnectionError("peer closed mid-batch")
        got += n


def _refuse(conn: socket.socket) -> None:
    """Answer the refusal without waiting (one byte into an empty send buffer) and close: what
    the peer sent and what it is still sending are never read."""
    with conn, contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(_REFUSED)


class LoopbackTransport(KvTransport):
    name = "loopback"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        timeout_s: float = 30.0,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
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
        self._slots = threading.BoundedSemaphore(max_connections)
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
                status = _send_batch(conn, segments)
        except OSError as exc:
            raise TransferError(f"loopback write to {endpoint} failed: {exc}") from exc
        if status != _OK:
            raise TransferError(
                f"{endpoint} refused the batch (a segment outside its registered memory, or "
                "every connection slot taken)"
            )

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
        or the port would go on taking connections that nothing reads. A connection beyond the
        cap is refused here, before it costs a thread."""
        at_cap = False  # said once per stretch at the cap: a flood must not flood the log too
        while True:
            try:
                conn, _ = server.accept()
            except OSError as exc:
                if server.fileno() < 0:  # closed
                    return
                log.warning("loopback transfer port: accept failed (%s); retrying", exc)
                time.sleep(ACCEPT_RETRY_S)
                continue
            if not self._slots.acquire(blocking=False):
                if not at_cap:
                    log.warning("loopback transfer port: every connection slot is taken; refusing")
                at_cap = True
                _refuse(conn)
                continue
            at_cap = False
            try:
                threading.Thread(target=self._receive, args=(conn,), daemon=True).start()
            except RuntimeError as exc:  # no thread to be had: this batch is refused
                self._slots.release()
                log.warning("loopback transfer port: no thread for a connection (%s)", exc)
                _refuse(conn)

    def _receive(self, conn: socket.socket) -> None:
        """One batch: the answer is OK only if every segment landed whole. The first segment
        that may not land ends the batch with the refusal, before its bytes are read."""
        deadline = time.monotonic() + self._timeout_s
        buffer = bytearray(READ_BUFFER)
        try:
            with conn:
                view = memoryview(buffer)
                _fill(conn, view[: _HEADER.size], deadline)
                (count,) = _HEADER.unpack_from(buffer)
                ok = count <= _MAX_SEGMENTS
                for _ in range(count if ok else 0):
                    ok = self._take_segment(conn, view, deadline)
                    if not ok:
                        break
                conn.sendall(_OK if ok else _REFUSED)
        except (OSError, ConnectionError) as exc:
            log.warning("loopback transfer broke off: %s", exc)
        finally:
            self._slots.release()

    def _take_segment(self, conn: socket.socket, view: memoryview, deadline: float) -> bool:
        """Read one segment's header and, only if it may land, its bytes, piece by piece
        through ``view``; False (nothing more read) if it may not, or its region is withdrawn
        while it lands."""
        _fill(conn, view[: _SEGMENT.size], deadline)
        dst, length = _SEGMENT.unpack_from(view)
        with self._lock:
            if not self._fits(dst, length):
                return False
        source = ctypes.addressof(ctypes.c_char.from_buffer(view))
        landed = 0
        while landed < length:
            n = min(length - landed, len(view))
            _fill(conn, view[:n], deadline)
            if not self._land(dst + landed, source, n):
                return False
            landed += n
        return True

    def _fits(self, address: int, length: int) -> bool:
        """Whether ``[address, +length)`` lies inside one registered region (lock held)."""
        return any(
            base <= address and address + length <= base + size
            for base, size in self._regions.items()
        )

    def _land(self, address: int, source: int, length: int) -> bool:
        with self._lock:
            if not self._fits(address, length):  # withdrawn since the header was checked
                return False
            ctypes.memmove(address, source, length)
            return True


def _send_batch(conn: socket.socket, segments: Sequence[Segment]) -> bytes:
    """Send one batch and return the port's status byte. The port refuses on a segment's header
    and closes without reading on: its refusal may be waiting while the send fails."""
    try:
        conn.sendall(_HEADER.pack(len(segments)))
        for segment in segments:
            conn.sendall(_SEGMENT.pack(segment.dst, segment.length))
            conn.sendall(ctypes.string_at(segment.src, segment.length))
    except OSError:
        with contextlib.suppress(OSError):
            if conn.recv(1) == _REFUSED:
                return _REFUSED
        raise
    status = conn.recv(1)
    if not status:
        raise ConnectionError("the port closed without an answer")
    return status
