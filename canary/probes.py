"""Canary probes: synthetic tenants exercise the real path through a running gateway.

Lifecycle of one probe run (``ProbeRunner.run``): make sure the probe tenants exist (synthetic,
sample rate 0, created through the admin API; a non-synthetic tenant of the same name is never
used) and give each a fresh short-lived key -> run each probe kind -> one ``ProbeResult`` per
check -> the caller prints them and reports them to ``POST /admin/canary/probe-runs``.

The probes issue their own markers with the canary key (``KVGUARD_CANARY_KEY``, the gateway's):
a request *carrying* its tenant's marker gets it back unstripped (``StreamScanner``'s carried
nonces), so a probe can see what the model copied.

- ``echo``: a chat whose system message holds marker M and whose question asks for the reference
  code; the answer must hold M and no other marker (needs a model that copies, e.g. the bundled
  ``kvguard-tiny``).
- ``capacity``: the real limit L of the model (largest enforceable limit of its routable engines,
  from the admin API); requests of L-1, L, L+1 tokens (prompt + max_tokens) and 1.5 L must get 200,
  200, 400 ``context_length_exceeded``, 400 ``context_length_exceeded``. Prompt sizes come from a
  two-point calibration of the engine's own counts (``usage.prompt_tokens``), checked again on
  every 200.
- ``cross_tenant``: tenant A's long request with marker MA, then at once tenant B's short one on
  the same model: B's answer must be a plain 200 holding no marker of A, not even its tag.
- ``abort``: A's long streamed request is dropped as soon as the gateway answers, then B's
  request: the same check.

Results name the engine that served them (the gateway tells synthetic tenants in
``x-kvguard-engine``). With several engines per model, ``cross_tenant`` and ``abort`` only prove
something when A and B land on the same engine; the observed text says where they landed.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from canary.findings import ProbeKind
from canary.injection import reference_line
from canary.markers import (
    BASE32_CLASS,
    BODY_CHARS,
    MARKER_CHARS,
    PREFIX,
    Marker,
    MarkerCodec,
    encode_tag,
)
from gateway.db.models import utcnow
from gateway.hooks import ENGINE_HEADER

REFERENCE_REQUEST = "Repeat the reference code."
KEY_LIFETIME_S = 3600
CALIBRATION_UNITS = (8, 16)
UNIT = " a"
_MARKER_RE = re.compile(re.escape(PREFIX) + BASE32_CLASS + "{" + str(BODY_CHARS) + "}")


class ProbeSetupError(RuntimeError):
    """The probes cannot run at all (gateway unreachable, refused admin token, no model)."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    kind: ProbeKind
    engine: str | None
    expected: str
    observed: str
    passed: bool
    duration_ms: float
    started_at: Any = field(default_factory=utcnow)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "engine": self.engine,
            "expected": self.expected[:256],
            "observed": self.observed[:256],
            "passed": self.passed,
            "duration_ms": round(self.duration_ms, 3),
            "started_at": self.started_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class ProbeTenant:
    id: str
    name: str
    key: str = field(repr=False)

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


class GatewayClient:
    """The admin and tenant calls the probes make, over one ``httpx.AsyncClient``."""

    def __init__(self, client: httpx.AsyncClient, *, admin_token: str) -> None:
        self.http = client
        self._admin = {"Authorization": f"Bearer {admin_token}"}

    async def ensure_tenant(self, name: str) -> ProbeTenant:
        r = await self.http.get(f"/admin/tenants/{name}", headers=self._admin)
        if r.status_code == 404:
            body = {
                "name": name,
                "synthetic": True,
                "canary_sample_rate": 0.0,
                "key_name": "canary-probe",
                "key_expires_in_s": KEY_LIFETIME_S,
            }
            created = await self.http.post("/admin/tenants", json=body, headers=self._admin)
            _expect(created, 201, "create probe tenant")
            data = created.json()
            return ProbeTenant(id=data["tenant"]["id"], name=name, key=data["key"]["key"])
        _expect(r, 200, "read probe tenant")
        tenant = r.json()
        if not tenant.get("synthetic"):
            raise ProbeSetupError(
                f"tenant {name!r} exists and is not synthetic; refusing to use it"
            )
        body = {"name": "canary-probe", "expires_in_s": KEY_LIFETIME_S}
        issued = await self.http.post(f"/admin/tenants/{name}/keys", json=body, headers=self._admin)
        _expect(issued, 201, "issue probe key")
        return ProbeTenant(id=tenant["id"], name=name, key=issued.json()["key"])

    async def first_model(self, tenant: ProbeTenant) -> str:
        r = await self.http.get("/v1/models", headers=tenant.headers)
        _expect(r, 200, "list models")
        data = r.json().get("data") or []
        if not data:
            raise ProbeSetupError("the gateway serves no model right now")
        return str(data[0]["id"])

    async def real_limit(self, model: str) -> int | None:
        """The largest enforceable limit among the routable engines serving ``model``."""
        r = await self.http.get("/admin/engines", headers=self._admin)
        _expect(r, 200, "list engines")
        limits = [
            e["enforceable_limit"]
            for e in r.json()
            if e.get("model") == model and e.get("routable") and e.get("enforceable_limit")
        ]
        return max(limits) if limits else None

    async def report(self, run_id: str, results: Sequence[ProbeResult]) -> None:
        body = {"run_id": run_id, "results": [result.to_json() for result in results]}
        r = await self.http.post("/admin/canary/probe-runs", json=body, headers=self._admin)
        _expect(r, 201, "report probe results")

    async def complete(self, tenant: ProbeTenant, body: dict[str, Any], *, chat: bool) -> Answer:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if body.get("stream"):
            return await self._stream(tenant, path, body, chat=chat)
        r = await self.http.post(path, json=body, headers=tenant.headers)
        engine = r.headers.get(ENGINE_HEADER)
        data = _json(r)
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
                return Answer(r.status_code, _code(_json_bytes(await r.aread())), "", engine)
            parts: list[str] = []
            code: str | None = None
            async for line in r.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    code = _code(obj) or "error"
                    break
                for choice in obj.get("choices") or []:
                    piece = (
                        (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    )
                    parts.append(piece or "")
            return Answer(200, code, "".join(parts), engine)

    async def open_and_drop(self, tenant: ProbeTenant, body: dict[str, Any]) -> int:
        """Start a streamed chat and hang up as soon as the gateway answers; the status."""
        async with self.http.stream(
            "POST", "/v1/chat/completions", json=body, headers=tenant.headers
        ) as r:
            return r.status_code


def _expect(r: httpx.Response, status: int, what: str) -> None:
    if r.status_code != status:
        raise ProbeSetupError(f"{what}: HTTP {r.status_code}")


def _json(r: httpx.Response) -> dict[str, Any]:
    return _json_bytes(r.content)


def _json_bytes(content: bytes) -> dict[str, Any]:
    try:
        data = json.loads(content)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _code(data: dict[str, Any]) -> str | None:
    error = data.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def markers_in(codec: MarkerCodec, text: str) -> list[bytes]:
    """The nonces of the genuine markers in ``text``."""
    found = []
    for match in _MARKER_RE.finditer(text):
        verified = codec.verify(match.group(0))
        if verified is not None:
            found.append(verified.nonce)
    return found


def shows_tag(marker: Marker, text: str) -> bool:
    """Whether ``text`` holds the marker's prefix and owner tag (enough to name its tenant)."""
    return PREFIX + encode_tag(marker.tenant_tag) in text


def reference_chat(marker: Marker, *, filler: str = "") -> list[dict[str, str]]:
    system = reference_line(marker.text) + (f"\n{filler}" if filler else "")
    return [{"role": "system", "content": system}, {"role": "user", "content": REFERENCE_REQUEST}]


def filler_text(chars: int) -> str:
    sentence = "The harbor report lists the morning trains and the river levels. "
    return (sentence * (chars // len(sentence) + 1))[:chars].strip()


def calibrate(points: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """(tokens per unit, fixed tokens) from (units, prompt tokens) pairs, if they are linear."""
    (k1, p1), (k2, p2) = points[0], points[-1]
    per_unit, rest = divmod(p2 - p1, k2 - k1)
    if rest or per_unit < 1:
        return None
    fixed = p1 - per_unit * k1
    return (per_unit, fixed) if all(p == fixed + per_unit * k for k, p in points) else None


def boundary_plan(limit: int, per_unit: int, fixed: int) -> list[tuple[str, int, int, int]]:
    """(label, units, max_tokens, total) for L-1, L, L+1 and 1.5 L."""
    units = (limit - 2 - fixed) // per_unit
    if units < 1:
        raise ValueError(f"a limit of {limit} tokens leaves no room for a calibrated prompt")
    prompt = fixed + per_unit * units
    deltas = (("limit-1", -1), ("limit", 0), ("limit+1", 1))
    plan = [(label, units, limit - prompt + delta, limit + delta) for label, delta in deltas]
    far_units = math.ceil((math.ceil(1.5 * limit) - fixed) / per_unit)
    plan.append(("1.5x", far_units, 1, fixed + per_unit * far_units + 1))
    return plan


class ProbeRunner:
    def __init__(
        self,
        gateway: GatewayClient,
        codec: MarkerCodec,
        *,
        tenant_prefix: str = "canary-probe",
        model: str | None = None,
    ) -> None:
        self.gateway = gateway
        self.codec = codec
        self.tenant_prefix = tenant_prefix
        self.model = model
        self._a: ProbeTenant | None = None
        self._b: ProbeTenant | None = None

    async def setup(self) -> None:
        self._a = await self.gateway.ensure_tenant(f"{self.tenant_prefix}-a")
        self._b = await self.gateway.ensure_tenant(f"{self.tenant_prefix}-b")
        if self.model is None:
            self.model = await self.gateway.first_model(self._a)

    async def run(self, kinds: Sequence[ProbeKind]) -> list[ProbeResult]:
        await self.setup()
        results: list[ProbeResult] = []
        for kind in kinds:
            started = time.perf_counter()
            try:
                results.extend(await self._run_kind(kind))
            except (httpx.HTTPError, ProbeSetupError, ValueError, KeyError) as exc:
                elapsed = (time.perf_counter() - started) * 1000
                observed = f"error: {exc.__class__.__name__}: {str(exc)[:120]}"
                results.append(
                    ProbeResult(kind, None, "the probe completes", observed, False, elapsed)
                )
        return results

    async def _run_kind(self, kind: ProbeKind) -> list[ProbeResult]:
        if kind is ProbeKind.ECHO:
            return [await self.echo()]
        if kind is ProbeKind.CAPACITY:
            return await self.capacity()
        if kind is ProbeKind.CROSS_TENANT:
            return [await self.pair(abort=False)]
        return [await self.pair(abort=True)]

    def _tenants(self) -> tuple[ProbeTenant, ProbeTenant, str]:
        if self._a is None or self._b is None or self.model is None:
            raise ProbeSetupError("setup() has not run")
        return self._a, self._b, self.model

    async def echo(self) -> ProbeResult:
        a, _, model = self._tenants()
        started = time.perf_counter()
        marker = self.codec.issue(a.id)
        body = {
            "model": model,
            "messages": reference_chat(marker),
            "max_tokens": MARKER_CHARS + 8,
            "temperature": 0.0,
            "stream": True,
        }
        answer = await self.gateway.complete(a, body, chat=True)
        found = markers_in(self.codec, answer.text)
        own = marker.nonce in found
        others = sum(1 for nonce in found if nonce != marker.nonce)
        passed = answer.status == 200 and answer.code is None and own and others == 0
        observed = (
            f"{answer.status}{' ' + answer.code if answer.code else ''}, own marker "
            f"{'echoed' if own else 'missing'}, {others} other"
        )
        expected = "200, own marker echoed, 0 other"
        return ProbeResult(ProbeKind.ECHO, answer.engine, expected, observed, passed, _ms(started))

    async def capacity(self) -> list[ProbeResult]:
        a, _, model = self._tenants()
        limit = await self.gateway.real_limit(model)
        if limit is None:
            raise ProbeSetupError(f"no routable engine reports a limit for {model!r}")
        points = []
        for units in CALIBRATION_UNITS:
            answer = await self._prompt(a, model, units, max_tokens=1)
            if answer.status != 200 or answer.prompt_tokens is None:
                raise ProbeSetupError(f"calibration request answered {answer.status}")
            points.append((units, answer.prompt_tokens))
        fit = calibrate(points)
        if fit is None:
            raise ProbeSetupError("prompt sizes are not linear in the calibration text")
        results = []
        for label, units, max_tokens, total in boundary_plan(limit, *fit):
            started = time.perf_counter()
            answer = await self._prompt(a, model, units, max_tokens=max_tokens)
            fits = total <= limit
            expected = "200" if fits else "400 context_length_exceeded"
            observed = f"{answer.status}{' ' + answer.code if answer.code else ''}"
            prompt = fit[1] + fit[0] * units
            if answer.status == 200 and answer.prompt_tokens != prompt:
                observed += f" (prompt counted {answer.prompt_tokens}, calibrated {prompt})"
            what = f"{label}: {total} of {limit} tokens -> {expected}"
            passed = observed == expected
            results.append(
                ProbeResult(ProbeKind.CAPACITY, answer.engine, what, observed, passed, _ms(started))
            )
        return results

    async def _prompt(
        self, tenant: ProbeTenant, model: str, units: int, *, max_tokens: int
    ) -> Answer:
        body = {
            "model": model,
            "prompt": UNIT * units,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        return await self.gateway.complete(tenant, body, chat=False)

    async def pair(self, *, abort: bool) -> ProbeResult:
        a, b, model = self._tenants()
        started = time.perf_counter()
        limit = await self.gateway.real_limit(model) or 1024
        marker = self.codec.issue(a.id)
        long_body = {
            "model": model,
            "messages": reference_chat(marker, filler=filler_text(max(0, limit // 2 - 100))),
            "max_tokens": 8,
            "temperature": 0.0,
            "stream": True,
        }
        if abort:
            first = await self.gateway.open_and_drop(a, long_body)
            long_desc = f"A dropped at {first}"
        else:
            long_answer = await self.gateway.complete(a, long_body, chat=True)
            long_desc = f"A {long_answer.status} on {long_answer.engine}"
        short = {
            "model": model,
            "messages": [{"role": "user", "content": REFERENCE_REQUEST}],
            "max_tokens": MARKER_CHARS + 8,
            "temperature": 0.0,
            "stream": True,
        }
        answer = await self.gateway.complete(b, short, chat=True)
        leaked = marker.nonce in markers_in(self.codec, answer.text) or shows_tag(
            marker, answer.text
        )
        others = len(markers_in(self.codec, answer.text))
        passed = answer.status == 200 and answer.code is None and not leaked and others == 0
        observed = (
            f"{long_desc}; B {answer.status}{' ' + answer.code if answer.code else ''} on "
            f"{answer.engine}, A's marker {'LEAKED' if leaked else 'absent'}, {others} markers"
        )
        kind = ProbeKind.ABORT if abort else ProbeKind.CROSS_TENANT
        expected = "B 200 with no marker of A"
        return ProbeResult(kind, answer.engine, expected, observed, passed, _ms(started))


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def format_table(results: Sequence[ProbeResult]) -> str:
    header = f"{'kind':<13} {'engine':<16} {'result':<6} {'ms':>9}  expected | observed"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.kind.value:<13} {(r.engine or '-'):<16} {'PASS' if r.passed else 'FAIL':<6} "
            f"{r.duration_ms:>9.1f}  {r.expected} | {r.observed}"
        )
    passed = sum(r.passed for r in results)
    lines.append(f"{passed}/{len(results)} passed")
    return "\n".join(lines)
