"""Who may call an engine: the deployment's engine credential, and prefill's known decode peers.

An engine trusts what its callers send: the tenant in ``X-Kvguard-Tenant``, the prompt, and on
prefill the transfer target and page addresses it writes KV to. So every route but two takes
``Authorization: Bearer <KVGUARD_ENGINE_TOKEN>``, which only the gateway and the decode role of the
same deployment hold (``EngineAuthMiddleware``; a missing or wrong credential is a 401 before the
body is read). Open without it: ``/health`` (liveness probes; it names the role and the model)
and ``/metrics`` (Prometheus scrapes it; engine series carry no tenant and no content). A
development engine without a token configured is open (``kvguard up``, the demo and the drill
stack configure one anyway); production refuses to start without a strong one.

Prefill writes into whatever target a handoff names, so it also checks the target against the
decode peers it knows (``KVGUARD_DECODE_PEERS``: hosts, or ``host:port`` transfer endpoints): a
handoff aimed anywhere else is refused (403 ``target_not_allowed``) before anything is computed,
even with the credential. Unset, only loopback targets are accepted (one host: the embedded and
drill stacks); production requires the list.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

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


def target_allowed(endpoint: str, peers: list[str] | None) -> bool:
    """Whether prefill may write to the transfer ``endpoint`` (``host:port``) given the known
    decode ``peers`` (hosts or ``host:port``; None: loopback only)."""
    host = endpoint.rpartition(":")[0] if ":" in endpoint else endpoint
    if peers is None:
        return host in LOOPBACK_HOSTS or host.startswith("127.")
    return endpoint in peers or host in peers
