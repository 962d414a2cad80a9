"""The gateway calls the canary probes make: admin (probe tenants, their keys, engine limits,
reports) and tenant (completions, streamed or dropped mid-stream), over one ``httpx.AsyncClient``.

Probe keys are short-lived (``KEY_LIFETIME_S``) and named ``canary-probe``; the runner reuses
them across scheduled rounds and revokes them when it replaces them or stops
(``ProbeRunner.close``), so a probe schedule keeps at most two live keys per tenant.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import httpx

from contracts.plugins import ENGINE_HEADER
from contracts.sse import SseSplitter, parse_event

KEY_LIFETIME_S = 3600
KEY_NAME = "canary-probe"

T = TypeVar("T")


class ProbeSetupError(RuntimeError):
    """The probes cannot run at all (gateway unreachable, refused admin token, no model)."""


@dataclass(frozen=True, slots=True)
class ProbeTenant:
    id: str
    name: str
    key: str = field(repr=False)
    key_prefix: str | None = None
    key_expires_at: datetime | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass(frozen=True, slots=True)
class Answer:
    """One response as a probe sees it. ``text`` may hold markers: never logged or stored."""

    status: int
    code: str | None
    text: str = field(repr=False)
    engine: str | None
    prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Dropped:
    """A streamed request the probe hung up on: the status, the engine, and whether the stream
    was still running (an event received, no end seen) when the probe dropped it."""

    status: int
    engine: str | None
    code: str | None = None
    mid_stream: bool = False

    def describe(self) -> str:
        if self.status != 200 or self.code is not None:
            return f"A {self.status}{' ' + self.code if self.code else ''}"
        if not self.mid_stream:
            return f"A ended on {self.engine} before the drop"
        return f"A dropped mid-stream on {self.engine}"


class GatewayClient:
    """The admin and tenant calls the probes make, over one ``httpx.AsyncClient``."""

    def __init__(self, client: httpx.AsyncClient, *, admin_token: str) -> None:
        self.http = client
        self._admin = {"Authorization": f"Bearer {admin_token}"}

    async def ensure_tenant(self, name: str) -> ProbeTenant:
        """The synthetic tenant ``name`` (created if missing) with a fresh probe key."""
        r = await self.http.get(f"/admin/tenants/{name}", headers=self._admin)
        if r.status_code == 404:
            body = {
                "name": name,
                "synthetic": True,
                "canary_sample_rate": 0.0,
                "key_name": KEY_NAME,
                "key_expires_in_s": KEY_LIFETIME_S,
            }
            created = await self.http.post("/admin/tenants", json=body, headers=self._admin)
            _expect(created, 201, "create probe tenant")
            return _read(
                created, "create probe tenant", lambda d: _tenant(d["tenant"]["id"], name, d["key"])
            )
        _expect(r, 200, "read probe tenant")
        tenant = _read(r, "read probe tenant", lambda d: {**d})
        if not tenant.get("synthetic"):
            raise ProbeSetupError(
                f"tenant {name!r} exists and is not synthetic; refusing to use it"
            )
        body = {"name": KEY_NAME, "expires_in_s": KEY_LIFETIME_S}
        issued = await self.http.post(f"/admin/tenants/{name}/keys", json=body, headers=self._admin)
        _expect(issued, 201, "issue probe key")
        return _read(issued, "issue probe key", lambda d: _tenant(tenant["id"], name, d))

    async def revoke(self, tenant: ProbeTenant) -> None:
        if tenant.key_prefix is None:
            return
        r = await self.http.post(f"/admin/keys/{tenant.key_prefix}/revoke", headers=self._admin)
        _expect(r, 200, "revoke probe key")

    async def first_model(self, tenant: ProbeTenant) -> str:
        r = await self.http.get("/v1/models", headers=tenant.headers)
        _expect(r, 200, "list models")
        ids = _read(r, "list models", lambda d: [str(m["id"]) for m in d.get("data") or []])
        if not ids:
            raise ProbeSetupError("the gateway serves no model right now")
        return ids[0]

    async def engine_limits(self, model: str) -> dict[str, int]:
        """Each routable engine serving ``model`` -> its own max_request_tokens."""
        r = await self.http.get("/admin/engines", headers=self._admin)
        _expect(r, 200, "list engines")
        return _read(
            r,
            "list engines",
            lambda engines: {
                str(e["name"]): int(e["max_request_tokens"])
                for e in engines
                if e.get("model") == model and e.get("routable") and e.get("max_request_tokens")
            },
        )

    async def report(self, run_id: str, results: Sequence[Any]) -> None:
        body = {"run_id": run_id, "results": [result.to_json() for result in results]}
        r = await self.http.post("/admin/canary/probe-runs", json=body, headers=self._admin)
        _expect(r, 201, "report probe results")

    async def complete(self, tenant: ProbeTenant, body: dict[str, Any], *, chat: bool) -> Answer:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if body.get("stream"):
            return await self._stream(tenant, path, body, chat=chat)
        r = await self.http.post(path, json=body, headers=tenant.headers)
        engine = r.headers.get(ENGINE_HEADER)
        data = _json(r.content)
        if r.status_code != 200:
            return Answer(r.status_code, _code(data), "", engine)
        choice = (data.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
        usage = data.get("usage") or {}
        return Answer(200, None, text or "", engine, usage.get("prompt_tokens"))

    async def _stream(
        self, tenant: ProbeTenant, path: str, body: dict[str, Any], *, chat: bool
    ) -> Answer:
        async with self.http.stream("POST", path, json=body, headers=tenant.headers) as r:
            engine = r.headers.get(ENGINE_HEADER)
            if r.status_code != 200:
                return Answer(r.status_code, _code(_json(await r.aread())), "", engine)
            parts: list[str] = []
            code: str | None = None
            async for obj in _events(r):
                if "error" in obj:
                    code = _code(obj) or "error"
                    break
                for choice in obj.get("choices") or []:
                    piece = (
                        (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    )
                    parts.append(piece or "")
            return Answer(200, code, "".join(parts), engine)

    async def open_and_drop(self, tenant: ProbeTenant, body: dict[str, Any]) -> Dropped:
        """Start a streamed chat and hang up after its first event, while it is still running."""
        async with self.http.stream(
            "POST", "/v1/chat/completions", json=body, headers=tenant.headers
        ) as r:
            engine = r.headers.get(ENGINE_HEADER)
            if r.status_code != 200:
                return Dropped(r.status_code, engine, _code(_json(await r.aread())))
            async for obj in _events(r):
                if "error" in obj:
                    return Dropped(200, engine, _code(obj) or "error")
                ended = any(c.get("finish_reason") for c in obj.get("choices") or [])
                return Dropped(200, engine, mid_stream=not ended)
            return Dropped(200, engine)  # [DONE] (or nothing) before any event


async def _events(r: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an SSE body, up to ``[DONE]``."""
    splitter = SseSplitter()  # SSE lines end at CR/LF only; aiter_lines also breaks at U+2028
    async for chunk in r.aiter_bytes():
        for event in splitter.feed(chunk):
            data = (parse_event(event)[0] or "").strip()
            if data == "[DONE]":
                return
            if data:
                obj = json.loads(data)
                yield obj if isinstance(obj, dict) else {}


def _tenant(tenant_id: str, name: str, key: dict[str, Any]) -> ProbeTenant:
    expires = key.get("expires_at")
    return ProbeTenant(
        id=tenant_id,
        name=name,
        key=key["key"],
        key_prefix=key.get("prefix"),
        key_expires_at=datetime.fromisoformat(expires) if expires else None,
    )


def _read(r: httpx.Response, what: str, read: Callable[[Any], T]) -> T:
    """``read`` of the answer's JSON; a ProbeSetupError when the answer is not the document the
    admin API sends (an ingress's maintenance page, a proxy's error), which would otherwise end
    the probe loop with a traceback."""
    try:
        return read(r.json())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProbeSetupError(f"{what}: not the answer the admin API sends") from exc


def _expect(r: httpx.Response, status: int, what: str) -> None:
    if r.status_code != status:
        raise ProbeSetupError(f"{what}: HTTP {r.status_code}")


def _json(content: bytes) -> dict[str, Any]:
    try:
        data = json.loads(content)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _code(data: dict[str, Any]) -> str | None:
    error = data.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None
