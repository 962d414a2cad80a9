"""A peer of the KV transfer port that holds no ticket and no credential, and the roles it attacks.

What it does is what any process on the engines' network (or any local user, on one host) can:

- ``segment``: Mooncake's P2P handshake, spoken by hand (``HandShakeRequestType::Metadata``,
  Mooncake's ``transfer_metadata_plugin.cpp``: an 8-byte length, the type byte, JSON), which
  answers with the process's segment descriptor -- every registered buffer's address and length.
- ``MooncakePeer``: its own ``TransferEngine`` (the installed mooncake-transfer-engine), which
  reads (``batch_transfer_sync_read``) and writes (``batch_transfer_sync_write``) any range of a
  registered buffer of a role it names, with no authentication.
- ``loopback_write``: the loopback transport's protocol (``backend.transport.loopback``), which
  writes into whatever its receiver has registered; it has no read.

``looks_like_kv`` tells float32 KV from ciphertext by the bytes that hold the floats' sign and
exponent (in KV a few values dominate them; in AES-GCM output every byte value is as likely).
``Role`` starts a ``kvguard backend`` process with its log in a file the test reads as it runs.
"""

from __future__ import annotations

import collections
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from kvguard.localservices import free_port
from kvguard.testing import stop_process, wait_for_health

METADATA = 1  # HandShakeRequestType::Metadata


@dataclass(frozen=True, slots=True)
class Buffer:
    address: int
    length: int


def segment(endpoint: str, timeout_s: float = 5.0) -> list[Buffer]:
    """Every buffer the process behind the Mooncake ``endpoint`` has registered right now."""
    host, _, port = endpoint.rpartition(":")
    body = bytes([METADATA]) + json.dumps({"name": "peer"}).encode()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
        conn.sendall(struct.pack("<Q", len(body)) + body)
        (length,) = struct.unpack("<Q", _exactly(conn, 8))
        reply = _exactly(conn, length)
    assert reply[0] == METADATA, reply[:16]
    descriptor = json.loads(reply[1:])
    return [Buffer(b["addr"], b["length"]) for b in descriptor.get("buffers", [])]


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


class MooncakePeer:
    """The attacker's own transfer engine and scratch memory."""

    def __init__(self, scratch_bytes: int = 1 << 20) -> None:
        from mooncake.engine import TransferEngine

        self.engine: Any = TransferEngine()
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.scratch = torch.zeros(scratch_bytes, dtype=torch.uint8)

    def read(self, endpoint: str, buffer: Buffer) -> bytes | None:
        length = min(buffer.length, self.scratch.numel())
        rc = self.engine.batch_transfer_sync_read(
            endpoint, [self.scratch.data_ptr()], [buffer.address], [length]
        )
        return None if rc != 0 else bytes(self.scratch[:length].numpy())

    def write(self, endpoint: str, buffer: Buffer, data: bytes) -> bool:
        length = min(buffer.length, len(data), self.scratch.numel())
        self.scratch[:length] = torch.frombuffer(bytearray(data[:length]), dtype=torch.uint8)
        rc = self.engine.batch_transfer_sync_write(
            endpoint, [self.scratch.data_ptr()], [buffer.address], [length]
        )
        return rc == 0


def loopback_write(endpoint: str, address: int, data: bytes) -> bool:
    """One batch of one segment; True if the receiver took it (the address was registered).
    A refused header closes the connection before its bytes are read: the send may break."""
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        try:
            conn.sendall(struct.pack("!I", 1) + struct.pack("!QQ", address, len(data)) + data)
            return _exactly(conn, 1) == b"\x00"
        except (BrokenPipeError, ConnectionResetError, ConnectionError):
            return False


def looks_like_kv(raw: bytes) -> bool:
    """Whether the non-zero words of ``raw`` read as float32 values: the share of their commonest
    sign-and-exponent byte is far above the 1/256 of random bytes. (Zero words -- slots nothing
    landed in yet -- are left out.)"""
    words = [raw[i : i + 4] for i in range(0, len(raw) - 3, 4)]
    high = [word[3] for word in words if word != b"\x00\x00\x00\x00"]
    if len(high) < 256:
        return False
    top = collections.Counter(high).most_common(1)[0][1]
    return top / len(high) > 0.1


def kv_like_bytes(n: int) -> bytes:
    """What an attacker would write to steer an answer: bytes that read as KV (float32)."""
    return torch.full((n // 4,), 0.37, dtype=torch.float32).numpy().tobytes()


def listening_host(port: int) -> str:
    """The local address a TCP listener on ``port`` is bound to (from /proc/net/tcp{,6})."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                    return _address(address)
    raise LookupError(f"nothing listens on port {port}")


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


@dataclass
class Role:
    """A ``kvguard backend ROLE`` process on a free port, its log in a file."""

    role: str
    env: dict[str, str]
    options: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, model: str) -> None:
        argv = [sys.executable, "-m", "kvguard", "backend", self.role, "--port", str(self.port)]
        argv += ["--model", model, "--page-size", "16", *self.options]
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")},
            "KVGUARD_TORCH_THREADS": "1",
            "GLOG_minloglevel": "2",
            **self.env,
        }
        fd, self.log_path = tempfile.mkstemp(prefix=f"kvguard-{self.role}-", suffix=".log")
        self.proc = subprocess.Popen(argv, env=env, stdout=fd, stderr=subprocess.STDOUT)
        os.close(fd)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_healthy(self) -> None:
        assert self.proc is not None
        wait_for_health(self.proc, self.url, self.role, self.log, 120.0, {"role": self.role})

    def logged(self, pattern: str) -> re.Match[str]:
        found = re.search(pattern, self.log())
        assert found is not None, f"{pattern!r} not in the {self.role} log:\n{self.log()[-3000:]}"
        return found

    def stop(self) -> None:
        stop_process(self.proc, grace_s=10.0)
        if self.log_path and os.path.exists(self.log_path):
            os.unlink(self.log_path)
