"""The loopback transfer port's bounds against any local user (the port takes no credential):
a segment's header is checked against registered memory before any of its bytes are read (a
destination outside a region, or a length past the region's end, is refused and the connection
closed at once), bytes land through a bounded buffer, connections beyond the cap are refused at
accept, and a connection holds its slot for one deadline in total, however slowly it trickles.

Real sockets on 127.0.0.1 against a real ``LoopbackTransport``; the attacker speaks the protocol
by hand. Nothing waits on a sleep: each step waits on a socket with a timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from backend.transport.base import Segment, TransferError
from backend.transport.loopback import MAX_CONNECTIONS, LoopbackTransport
from kvguard.testing import wait_for

REGION = 4096
MiB = 1 << 20
ANSWER_S = 5.0  # an answer the fixed port gives at once; the old port never gave it


@contextlib.contextmanager
def _receiver(
    *, timeout_s: float = 30.0, max_connections: int = MAX_CONNECTIONS
) -> Iterator[tuple[LoopbackTransport, int]]:
    """A receiving transport with one registered region of ``REGION`` bytes at the address given."""
    memory = ctypes.create_string_buffer(REGION)
    receiver = LoopbackTransport(timeout_s=timeout_s, max_connections=max_connections)
    receiver.register(ctypes.addressof(memory), REGION)
    try:
        yield receiver, ctypes.addressof(memory)
    finally:
        receiver.close()
        del memory


def _connect(endpoint: str) -> socket.socket:
    host, _, port = endpoint.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=ANSWER_S)


def _header(dst: int, length: int) -> bytes:
    return struct.pack("!I", 1) + struct.pack("!QQ", dst, length)


def _answer(conn: socket.socket) -> bytes:
    """The port's status byte, or b"" if it closed without one (TimeoutError if it waits on)."""
    try:
        return conn.recv(1)
    except ConnectionResetError:
        return b""


@pytest.mark.parametrize(
    ("where", "offset", "length"),
    [
        ("unregistered, 64 GiB", None, 1 << 36),
        ("unregistered, one byte", None, 1),
        ("the region plus one byte", 0, REGION + 1),
        ("one byte past the region's end", REGION - 96, 97),
        ("at the region's end", REGION, 1),
        ("inside, 64 GiB", 8, 1 << 36),
        ("largest length", 0, (1 << 64) - 1),
    ],
)
def test_a_header_that_cannot_land_is_refused_before_its_bytes_are_sent(
    where: str, offset: int | None, length: int
) -> None:
    """Only the header is sent: the port answers ``_REFUSED`` and closes without waiting for a
    byte of the segment (the old port waited for all ``length`` bytes, buffering them)."""
    with _receiver() as (receiver, base):
        dst = 1 if offset is None else base + offset
        with _connect(receiver.endpoint) as conn:
            conn.sendall(_header(dst, length))
            assert conn.recv(1) == b"\x01", where
            assert _answer(conn) == b""  # closed


def test_a_huge_segment_is_refused_while_the_attacker_is_still_sending() -> None:
    """The audit's attack: count=1, dst=1, length=2^36, then bytes as fast as loopback takes
    them. The port refuses on the header and closes: the sender is cut off after what the
    socket buffers hold, not after 64 GiB (the old port read on, into one growing list)."""
    with _receiver() as (receiver, _):
        sent = 0
        chunk = b"\x5a" * MiB
        with _connect(receiver.endpoint) as conn:
            conn.sendall(_header(1, 1 << 36))
            with pytest.raises(OSError):  # EPIPE or ECONNRESET once the port closed
                while sent < 256 * MiB:
                    sent += conn.send(chunk)
        assert sent < 64 * MiB, f"{sent} bytes went in before the port closed"


def test_a_segment_that_ends_exactly_at_the_regions_end_lands_and_large_ones_land_whole() -> None:
    """The bound is exact (a segment may fill its region to the last byte), and a segment larger
    than the port's read buffer lands whole, every byte where it was sent."""
    big = 3 * MiB + 7
    memory = ctypes.create_string_buffer(big)
    source = ctypes.create_string_buffer(bytes(i % 251 for i in range(big)), big)
    receiver, sender = LoopbackTransport(), LoopbackTransport()
    try:
        receiver.register(ctypes.addressof(memory), big)
        src, dst = ctypes.addressof(source), ctypes.addressof(memory)
        sender.write(receiver.endpoint, [Segment(src, dst + big - 96, 96)])
        assert memory.raw[big - 96 :] == source.raw[:96]
        sender.write(receiver.endpoint, [Segment(src, dst, big)])
        assert memory.raw == source.raw
        with pytest.raises(TransferError, match="refused"):
            sender.write(receiver.endpoint, [Segment(src, dst + big - 96, 97)])
    finally:
        sender.close()
        receiver.close()


def test_connections_beyond_the_cap_are_refused_at_accept_and_the_port_recovers() -> None:
    """``cap`` idle connections hold every slot: the next is answered ``_REFUSED`` and closed
    at once (it got no thread); once they go, an honest batch lands again."""
    cap = 4
    payload = ctypes.create_string_buffer(b"kv" * 32, 64)
    with _receiver(max_connections=cap) as (receiver, base):
        held = [_connect(receiver.endpoint) for _ in range(cap)]
        try:
            with _connect(receiver.endpoint) as extra:
                assert extra.recv(1) == b"\x01"
                assert _answer(extra) == b""
        finally:
            for conn in held:
                conn.close()
        sender = LoopbackTransport()
        try:
            segment = Segment(ctypes.addressof(payload), base, 64)
            wait_for(lambda: _lands(sender, receiver.endpoint, segment), 10, "a slot freed")
            assert ctypes.string_at(base, 64) == payload.raw
        finally:
            sender.close()


def test_the_default_cap_is_small() -> None:
    assert 1 <= MAX_CONNECTIONS <= 64


def _lands(sender: LoopbackTransport, endpoint: str, segment: Segment) -> bool:
    try:
        sender.write(endpoint, [segment])
    except TransferError:
        return False
    return True


def test_a_trickling_connection_is_closed_after_one_deadline_in_total() -> None:
    """A byte every 0.2 s never trips a per-read timeout of 1 s; the port's deadline counts the
    whole connection, so it is closed soon after 1 s (the old port kept it for as long as the
    bytes came)."""
    with _receiver(timeout_s=1.0) as (receiver, base):
        pace = threading.Event()  # never set: its wait is the pace of the trickle
        started = time.monotonic()
        closed = False
        with _connect(receiver.endpoint) as conn:
            conn.sendall(_header(base, REGION))
            while not closed and time.monotonic() - started < 8.0:
                closed = _trickle(conn)
                if not closed:
                    pace.wait(0.2)
        assert closed, "the port kept a trickling connection for 8 s"
        assert time.monotonic() - started < 4.0


def _trickle(conn: socket.socket) -> bool:
    """Send one more byte; True once the port has closed the connection."""
    try:
        conn.sendall(b"\x00")
        readable, _, _ = select.select([conn], [], [], 0)  # the port never sends while it reads
        return bool(readable) and conn.recv(1) == b""
    except OSError:  # EPIPE or ECONNRESET: closed
        return True
