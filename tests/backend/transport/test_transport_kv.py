"""Every KV transport: a batch lands whole, a destination outside registered memory is refused,
and a region withdrawn with ``unregister`` takes no write; the loopback transport listens only
where it is told (a loopback address).

Mooncake runs for real here (two transfer engines in this process, TCP on 127.0.0.1).
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import torch

from backend.transport.base import KvTransport, Segment, TransferError, TransportUnavailable
from backend.transport.inprocess import InProcessTransport
from backend.transport.loopback import LoopbackTransport
from backend.transport.mooncake import MooncakeTransport
from kvguard.testing import wait_for

FACTORIES: dict[str, Callable[[], KvTransport]] = {
    "inprocess": InProcessTransport,
    "loopback": LoopbackTransport,
    "mooncake": lambda: MooncakeTransport("127.0.0.1"),
}


@pytest.mark.parametrize("kind", list(FACTORIES))
def test_a_batch_lands_and_unregistered_memory_is_refused(kind: str) -> None:
    sender, receiver = FACTORIES[kind](), FACTORIES[kind]()
    src = torch.arange(4096, dtype=torch.int32)
    dst = torch.zeros(4096, dtype=torch.int32)
    outside = torch.zeros(16, dtype=torch.int32)
    try:
        sender.register(src.data_ptr(), src.numel() * 4)
        receiver.register(dst.data_ptr(), dst.numel() * 4)
        batch = [
            Segment(src.data_ptr(), dst.data_ptr() + 400, 400),
            Segment(src.data_ptr() + 8000, dst.data_ptr() + 8000, 4000),
        ]
        sender.write(receiver.endpoint, batch)
        assert torch.equal(dst[100:200], src[:100])
        assert torch.equal(dst[2000:3000], src[2000:3000])
        assert int(dst[:100].abs().sum()) == 0 and int(dst[3000:].abs().sum()) == 0
        with pytest.raises(TransferError):
            sender.write(receiver.endpoint, [Segment(src.data_ptr(), outside.data_ptr(), 64)])
        assert int(outside.abs().sum()) == 0
        receiver.unregister(dst.data_ptr())
        dst.zero_()
        with pytest.raises(TransferError):
            sender.write(receiver.endpoint, [Segment(src.data_ptr(), dst.data_ptr(), 400)])
        assert int(dst.abs().sum()) == 0
    finally:
        sender.close()
        receiver.close()


def test_loopback_never_writes_off_host() -> None:
    with pytest.raises(TransferError, match="only writes to this host, not 10.0.0.1"):
        LoopbackTransport().write("10.0.0.1:5000", [Segment(1, 1, 1)])


def test_loopback_listens_where_it_is_told_and_only_on_a_loopback_address() -> None:
    transport = LoopbackTransport(host="127.0.0.2")
    try:
        host, _, port = transport.endpoint.rpartition(":")
        assert host == "127.0.0.2"
        with socket.socket() as probe:  # nothing answers on the same port elsewhere
            assert probe.connect_ex(("127.0.0.1", int(port))) != 0
    finally:
        transport.close()
    for address in ("0.0.0.0", "10.0.0.1", "decode"):
        with pytest.raises(TransportUnavailable, match="listens on a loopback address"):
            LoopbackTransport(host=address)


def test_the_loopback_port_takes_batches_again_after_running_out_of_descriptors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Decode out of file descriptors for a moment while prefill connects (a burst): the accept
    fails with EMFILE. The port's accept thread took any error for "closed" and ended, and
    every later batch waited out its timeout on a port nobody read. Real here: the process's
    descriptor limit is lowered and every free descriptor held, then a child process connects
    (told to by a byte on its stdin, a pipe that needs no new descriptor here)."""
    receiver, sender = LoopbackTransport(timeout_s=5.0), LoopbackTransport(timeout_s=5.0)
    src = torch.arange(64, dtype=torch.int32)
    dst = torch.zeros(64, dtype=torch.int32)
    receiver.register(dst.data_ptr(), dst.numel() * 4)
    host, port = receiver.endpoint.rsplit(":", 1)
    connect = (
        "import socket, sys; sys.stdin.read(1); "
        f"socket.create_connection(({host!r}, {port})).recv(1)"
    )
    child = subprocess.Popen([sys.executable, "-c", connect], stdin=subprocess.PIPE)
    assert child.stdin is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        child.stdin.write(b"x")
        child.stdin.flush()
        wait_for(lambda: _accept_refused(caplog), 10, "an accept refused for a descriptor")
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        child.kill()
        child.wait()
    try:
        sender.write(receiver.endpoint, [Segment(src.data_ptr(), dst.data_ptr(), 256)])
        assert torch.equal(dst, src)
    finally:
        sender.close()
        receiver.close()


def _accept_refused(caplog: pytest.LogCaptureFixture) -> bool:
    """The port's accept failed: it said so (and retries), or its thread is gone."""
    said = any("accept failed" in record.getMessage() for record in caplog.records)
    return said or not any(t.name.endswith("(_accept)") for t in threading.enumerate())
