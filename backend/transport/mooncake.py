"""Mooncake's transfer engine as a ``KvTransport``.

Start-up: ``TransferEngine.initialize(host, "P2PHANDSHAKE", protocol, device)`` -- no metadata
server; peers find each other by ``host:rpc_port``, which is this transport's ``endpoint``.
``write`` is ``batch_transfer_sync_write``: it returns once the peer acknowledged every segment,
and the peer's server refuses any destination outside one of its registered buffers.

What any peer of the ports can do (mooncake-transfer-engine 0.3.13; Mooncake's
``transfer_metadata_plugin.cpp`` and ``transport/tcp_transport/tcp_transport.cpp``):

- Both listeners bind every interface, whatever ``host`` says: the handshake port
  (``findAvailableTcpPort``: ``INADDR_ANY``) and the TCP data port (``TcpContext``: ``::``,
  dual-stack). No setting of Mooncake's narrows them, so kvguard asks the deployment to say so
  (``KVGUARD_TRANSFER_BIND=0.0.0.0``; production refuses Mooncake otherwise).
- The handshake answers a ``Metadata`` request from anyone with this process's segment
  descriptor: every registered buffer's address and length.
- The data port reads (``READ``) and writes (``WRITE``) any range inside a registered buffer, with
  no authentication. A write validated before ``unregister`` may still land after it.

So the handoff registers nothing but each handoff's sealed landing slots, for that handoff alone
(``backend.disagg.channel``), and sources only where RDMA needs them (``registers_sources``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from backend.transport.base import KvTransport, Segment, TransferError, TransportUnavailable

log = logging.getLogger("kvguard.transport")

# The system libraries Mooncake's native module links against (libibverbs.so.1, libnuma.so.1,
# libcurl.so.4), by Debian package; tests/ops/test_ops_image.py derives them from the wheel.
SYSTEM_PACKAGES = ("libibverbs1", "libnuma1", "libcurl4")


class MooncakeTransport(KvTransport):
    name = "mooncake"

    def __init__(self, host: str, *, protocol: str = "tcp", device: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ModuleNotFoundError as exc:
            raise TransportUnavailable(
                "the Mooncake transfer engine is not installed (pip install "
                "'kvguard[mooncake]', i.e. mooncake-transfer-engine-non-cuda on CPU hosts); it "
                "is needed when prefill and decode run on separate hosts. With both roles on "
                "this host, set KVGUARD_TRANSPORT=loopback (TCP on 127.0.0.1, single-host only)"
            ) from exc
        except ImportError as exc:  # installed, but a system library it links against is not
            raise TransportUnavailable(
                f"the Mooncake transfer engine cannot load ({exc}); it needs the Debian/Ubuntu "
                f"packages {' '.join(SYSTEM_PACKAGES)} (the Dockerfile and scripts/bootstrap.sh "
                "install them)"
            ) from exc
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransportUnavailable(
                f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}"
            )
        self._endpoint = f"{host}:{self._engine.get_rpc_port()}"
        self._protocol = protocol
        self._registered: set[int] = set()
        log.info("Mooncake transfer engine at %s (%s)", self._endpoint, protocol)

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def registers_sources(self) -> bool:
        return self._protocol == "rdma"

    def register(self, address: int, length: int) -> None:
        rc = self._engine.register_memory(address, length)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory of {length} bytes returned {rc}")
        self._registered.add(address)

    def unregister(self, address: int) -> None:
        if address not in self._registered:
            return
        self._registered.discard(address)
        rc = self._engine.unregister_memory(address)
        if rc != 0:
            raise TransferError(f"Mooncake unregister_memory returned {rc}")

    def write(self, endpoint: str, segments: Sequence[Segment]) -> None:
        if not segments:
            return
        rc = self._engine.batch_transfer_sync_write(
            endpoint,
            [s.src for s in segments],
            [s.dst for s in segments],
            [s.length for s in segments],
        )
        if rc != 0:
            total = sum(s.length for s in segments)
            raise TransferError(
                f"Mooncake write of {len(segments)} segments ({total} bytes) to {endpoint} "
                f"returned {rc}"
            )

    def close(self) -> None:
        for address in list(self._registered):
            try:
                self.unregister(address)
            except TransferError as exc:
                log.error("closing the Mooncake transport: %s", exc)
