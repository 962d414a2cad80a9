"""Who may call an engine: the deployment's engine credential, and prefill's known decode peers.

An engine trusts what its callers send: the tenant in ``X-Kvguard-Tenant``, the prompt, and on
prefill the transfer target and page addresses it writes KV to. So every route but two takes
``Authorization: Bearer <KVGUARD_ENGINE_TOKEN>``, which only the gateway and the decode role of the
same deployment hold (``EngineAuthMiddleware``; a missing or wrong credential is a 401 before the
body is read). Open without it: ``/health`` (liveness probes; it names the role and the model)
and ``/metrics`` (Prometheus scrapes it; engine series carry no tenant and no content). A
development engine without a token configured is open (``kvguard up``, the demo and the drill
stack configure one anyway); production refuses to start without a strong one.

Prefill writes only where a decode peer said it may: each decode announces its exact transfer
target -- endpoint (host and port), instance, channel and memory -- through the handoff API
(``POST /kv/v1/decode``, with the credential, at start and with every capacity read), and prefill
keeps it (``DecodePeers``) only if the endpoint's host is one of its decode peers
(``KVGUARD_DECODE_PEERS``: hosts, or ``host:port``; unset: loopback hosts only; production
requires the list). A handoff whose target is not exactly an announced one -- another port of a
peer host, another memory range, an instance that has not announced itself or was replaced -- is
refused (403 ``target_not_allowed``) before anything is computed, even with the credential. A
prefill that is not itself on the open channel refuses open targets: it never sends plaintext KV.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from backend.disagg.protocol import KvChannel, TransferTarget
from contracts.http_edge import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]", "inprocess")
CREDENTIAL_CODE = "invalid_engine_credential"
TARGET_CODE = "target_not_allowed"


class EngineAuthMiddleware:
    """401 for any request outside ``OPEN_PATHS`` without the engine credential."""

    def __init__(self, app: ASGIApp, *, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        presented = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                presented = value
                break
        if hmac.compare_digest(presented, self._expected):
            await self.app(scope, receive, send)
            return
        await _refuse(send)


async def _refuse(send: Send) -> None:
    message = "This engine takes calls only from its deployment (missing or wrong credential)."
    body = json.dumps(
        error_body(message, code=CREDENTIAL_CODE, type_="authentication_error")
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
        (b"connection", b"close"),  # the unread body of a refused request is not drained
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def host_allowed(endpoint: str, peers: list[str] | None) -> bool:
    """Whether a decode may announce the transfer ``endpoint`` (``host:port``) given prefill's
    configured ``peers`` (hosts or ``host:port``; None: loopback only)."""
    host = endpoint.rpartition(":")[0] if ":" in endpoint else endpoint
    if peers is None:
        return host in LOOPBACK_HOSTS or host.startswith("127.")
    return endpoint in peers or host in peers


class DecodePeers:
    """Prefill's record of the exact targets its decode peers announced: one per decode
    instance, the newest per endpoint (a decode that restarted replaces its old instance), at
    most ``LIMIT`` (the oldest goes first)."""

    LIMIT = 64

    def __init__(self, peers: list[str] | None, *, accept_open: bool) -> None:
        self._peers = peers
        self._accept_open = accept_open
        self._by_instance: dict[str, TransferTarget] = {}

    def announce(self, target: TransferTarget) -> str | None:
        """Record ``target``; or say why it is refused."""
        if not host_allowed(target.endpoint, self._peers):
            return f"the transfer endpoint {target.endpoint} is not on a decode peer's host"
        if target.channel is KvChannel.OPEN and not self._accept_open:
            return "this prefill sends KV only over the sealed channel"
        for instance, known in list(self._by_instance.items()):
            if known.endpoint == target.endpoint and instance != target.instance_id:
                del self._by_instance[instance]
        self._by_instance.pop(target.instance_id, None)
        self._by_instance[target.instance_id] = target
        while len(self._by_instance) > self.LIMIT:
            del self._by_instance[next(iter(self._by_instance))]
        return None

    def allows(self, target: TransferTarget) -> bool:
        """Whether ``target`` is exactly what its decode instance announced."""
        return self._by_instance.get(target.instance_id) == target
