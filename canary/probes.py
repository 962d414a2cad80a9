"""Canary probes: synthetic tenants exercise the real path through a running gateway.

Lifecycle (``ProbeRunner``): ``setup`` makes sure the probe tenants exist (synthetic, sample rate
0, created through the admin API; a non-synthetic tenant of the same name is never used) and
holds one short-lived key each, reused run after run until it nears expiry (then replaced and
the old one revoked) -> ``run`` runs each probe kind -> one ``ProbeResult`` per check -> the
caller prints them and reports them to ``POST /admin/canary/probe-runs`` -> ``close`` revokes
the keys when the probes stop.

The probes issue their own markers with the canary key (``KVGUARD_CANARY_KEY``, the gateway's):
a request *carrying* its tenant's marker gets it back unstripped (``StreamScanner``'s carried
nonces), so a probe can see what the model copied.

- ``echo``: a chat whose system message holds marker M and whose question asks for the reference
  code; the answer must hold M and no other marker (needs a model that copies, e.g. the bundled
  ``kvguard-tiny``).
- ``capacity``: for each distinct limit L among the model's routable engines (each engine's own
  max_request_tokens, from the admin API), requests of L-1, L, L+1 tokens (prompt + max_tokens)
  and 1.5 L. Each must get 200 when some engine's own limit holds it (served by such an engine:
  the ``x-kvguard-engine`` it names) and 400 ``context_length_exceeded`` otherwise; with one
  engine: 200, 200, 400, 400. Prompt sizes come from a two-point calibration of the engine's own
  counts (``usage.prompt_tokens``), checked again on every 200.
- ``cross_tenant``: tenant A's long request with marker MA, then at once, on the same engine,
  tenant B's request sized near the limit (``b_body``), then B's short request: each answer
  must be a plain 200 holding no marker of A, not even its tag. The long one comes first because
  in the incident the reader of the stale pages was the request the engine could not really
  hold, straight after the victim's; the short one is the plain follow-up.
- ``abort``: A's long streamed request is dropped after its first event (the request is running
  on the engine, not yet finished: a stream that ended first fails the probe), then B's request:
  the same checks.

Pinning: the gateway picks the engine (least in flight, then round robin) and names it to
synthetic tenants in ``x-kvguard-engine``. Each of B's requests is sent again, up to once per
engine more, until it lands on A's engine; if it never does, the pair fails with "nothing proven"
instead of passing on another engine. (A pause of ``RETRY_PAUSE_S`` before each new try lets
the gateway count a dropped A out of its engine's in-flight requests, which it routes by.)
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
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
from canary.probe_client import (
    KEY_LIFETIME_S,
    Answer,
    GatewayClient,
    ProbeSetupError,
    ProbeTenant,
)
from contracts.sql import utcnow

__all__ = ["GatewayClient", "ProbeResult", "ProbeRunner", "ProbeSetupError", "format_table"]

REFERENCE_REQUEST = "Repeat the reference code."
KEY_RENEW_BEFORE_S = KEY_LIFETIME_S // 6  # a key with under 10 minutes left is replaced
ABORT_MAX_TOKENS = 64  # A keeps generating past the probe's drop
B_MAX_TOKENS = MARKER_CHARS + 8  # room to copy a whole marker
B_SLACK = 64  # tokens of chat template around B's text
RETRY_PAUSE_S = 0.2  # before B is sent again to reach A's engine
CALIBRATION_UNITS = (8, 16)
UNIT = " a"
_MARKER_RE = re.compile(re.escape(PREFIX) + BASE32_CLASS + "{" + str(BODY_CHARS) + "}")


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
    """Runs probe kinds with two synthetic tenants; keeps their keys across runs (``close``)."""

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
        """Probe tenants with live keys: reused from the last run unless near expiry."""
        self._a = await self._keyed(self._a, "a")
        self._b = await self._keyed(self._b, "b")
        if self.model is None:
            self.model = await self.gateway.first_model(self._a)

    async def _keyed(self, current: ProbeTenant | None, suffix: str) -> ProbeTenant:
        if current is not None and not _expiring(current):
            return current
        fresh = await self.gateway.ensure_tenant(f"{self.tenant_prefix}-{suffix}")
        if current is not None:
            await self.gateway.revoke(current)
        return fresh

    async def close(self) -> None:
        """Revoke the keys this runner holds: a stopped probe leaves no live key behind."""
        held, self._a, self._b = (self._a, self._b), None, None
        for tenant in held:
            if tenant is not None:
                await self.gateway.revoke(tenant)

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

    async def _limits(self, model: str) -> dict[str, int]:
        limits = await self.gateway.engine_limits(model)
        if not limits:
            raise ProbeSetupError(f"no routable engine reports a limit for {model!r}")
        return limits

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
        observed = f"{_status(answer)}, own marker {'echoed' if own else 'missing'}, {others} other"
        expected = "200, own marker echoed, 0 other"
        return ProbeResult(ProbeKind.ECHO, answer.engine, expected, observed, passed, _ms(started))

    async def capacity(self) -> list[ProbeResult]:
        """The boundary of every distinct engine limit, each probed at that engine's own limit."""
        a, _, model = self._tenants()
        limits = await self._limits(model)
        fit = await self._calibrate(a, model)
        results = []
        for limit, engine in sorted({lim: name for name, lim in limits.items()}.items()):
            for label, units, max_tokens, total in boundary_plan(limit, *fit):
                what = f"{label}: {total} of {limit} tokens ({engine}'s limit)"
                started = time.perf_counter()
                answer = await self._prompt(a, model, units, max_tokens=max_tokens)
                expected, observed = _judge(answer, total, limits, fit[1] + fit[0] * units)
                result = ProbeResult(
                    ProbeKind.CAPACITY,
                    answer.engine or engine,
                    f"{what} -> {expected}",
                    observed,
                    observed == expected,
                    _ms(started),
                )
                results.append(result)
        return results

    async def _calibrate(self, tenant: ProbeTenant, model: str) -> tuple[int, int]:
        points = []
        for units in CALIBRATION_UNITS:
            answer = await self._prompt(tenant, model, units, max_tokens=1)
            if answer.status != 200 or answer.prompt_tokens is None:
                raise ProbeSetupError(f"calibration request answered {answer.status}")
            points.append((units, answer.prompt_tokens))
        fit = calibrate(points)
        if fit is None:
            raise ProbeSetupError("prompt sizes are not linear in the calibration text")
        return fit

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
        """A's marked request (or A dropped mid-stream), then on A's engine B's short request
        near the limit (the one an engine that cannot really hold it would answer from stale
        pages, as in the incident), then B's short request (the plain follow-up)."""
        a, b, model = self._tenants()
        started = time.perf_counter()
        limits = await self._limits(model)
        limit = min(limits.values())  # A and B fit whichever engine they land on
        marker = self.codec.issue(a.id)
        long_body = {
            "model": model,
            # a quarter of the limit: A must really be held by the engine (its marker must be
            # in the KV), and a declared window may overstate the real pool (the incident's
            # engine held 65% of what it advertised)
            "messages": reference_chat(marker, filler=filler_text(max(0, limit // 4 - 100))),
            "max_tokens": ABORT_MAX_TOKENS if abort else 8,
            "temperature": 0.0,
            "stream": True,
        }
        if abort:
            dropped = await self.gateway.open_and_drop(a, long_body)
            a_engine, a_ok, a_desc = dropped.engine, dropped.mid_stream, dropped.describe()
        else:
            first = await self.gateway.complete(a, long_body, chat=True)
            a_engine, a_ok = first.engine, first.status == 200 and first.code is None
            a_desc = f"A {_status(first)} on {first.engine}"
        tries = len(limits) + 1
        groups = {
            # near the limit first, straight after A: the request that would read A's pages
            "near the limit": await self._b_on(a_engine, b, b_body(model, limit), tries=tries),
            "short": await self._b_on(a_engine, b, b_body(model, None), tries=tries),
        }
        return _pair_result(
            ProbeKind.ABORT if abort else ProbeKind.CROSS_TENANT,
            a_engine if a_ok else None,
            a_desc,
            groups,
            self._leak(marker, [answer for group in groups.values() for answer in group]),
            _ms(started),
        )

    async def _b_on(
        self, engine: str | None, b: ProbeTenant, body: dict[str, Any], *, tries: int
    ) -> list[Answer]:
        """B's request, sent again until it lands on ``engine`` (the gateway picks engines)."""
        answers: list[Answer] = []
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(RETRY_PAUSE_S)  # A's request may still count as in flight
            answers.append(await self.gateway.complete(b, body, chat=True))
            if engine is None or answers[-1].engine == engine or answers[-1].status != 200:
                break
        return answers

    def _leak(self, marker: Marker, answers: Sequence[Answer]) -> tuple[bool, int]:
        """(any answer holds A's marker or tag, how many genuine markers they hold)."""
        found = [markers_in(self.codec, answer.text) for answer in answers]
        leaked = any(
            marker.nonce in nonces or shows_tag(marker, answer.text)
            for nonces, answer in zip(found, answers, strict=True)
        )
        return leaked, sum(len(nonces) for nonces in found)


def b_body(model: str, limit: int | None) -> dict[str, Any]:
    """B's streamed chat: short (``limit`` None), or sized near ``limit`` (characters never
    outnumber tokens by much less than one each; ``B_SLACK`` covers the chat template): a
    request the engine cannot really hold reads someone's stale pages, as in the incident, and
    a short one would not."""
    room = 0 if limit is None else limit - B_MAX_TOKENS - B_SLACK - len(REFERENCE_REQUEST)
    filler = filler_text(max(0, room))
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"{filler}\n{REFERENCE_REQUEST}".lstrip()}],
        "max_tokens": B_MAX_TOKENS,
        "temperature": 0.0,
        "stream": True,
    }


def _pair_result(
    kind: ProbeKind,
    a_engine: str | None,
    a_desc: str,
    groups: Mapping[str, Sequence[Answer]],
    leak: tuple[bool, int],
    duration_ms: float,
) -> ProbeResult:
    """Each of B's requests must land on A's engine (else the pair proves nothing and fails)
    with clean 200s."""
    leaked, markers = leak
    lasts = [answers[-1] for answers in groups.values()]
    same = a_engine is not None and all(last.engine == a_engine for last in lasts)
    clean = all(a.status == 200 and a.code is None for answers in groups.values() for a in answers)
    bs = ", ".join(
        f"B {label} {_status(answers[-1])} on {answers[-1].engine}"
        + (f" (try {len(answers)})" if len(answers) > 1 else "")
        for label, answers in groups.items()
    )
    observed = f"{a_desc}; {bs}, A's marker {'LEAKED' if leaked else 'absent'}, {markers} markers"
    if a_engine is not None and not same and clean:
        observed += "; B never reached A's engine: nothing proven"
    passed = same and clean and not leaked and markers == 0
    expected = "A on an engine, then B's short and near-limit requests 200 there, no marker of A"
    return ProbeResult(kind, a_engine or lasts[-1].engine, expected, observed, passed, duration_ms)


def _judge(answer: Answer, total: int, limits: dict[str, int], prompt: int) -> tuple[str, str]:
    """(expected, observed) of one boundary request of ``total`` tokens: 200 only if some
    engine's own limit holds it, and then from an engine whose limit does."""
    expected = (
        "200" if any(total <= lim for lim in limits.values()) else "400 context_length_exceeded"
    )
    observed = _status(answer)
    if answer.status == 200 and answer.prompt_tokens != prompt:
        observed += f" (prompt counted {answer.prompt_tokens}, calibrated {prompt})"
    own = limits.get(answer.engine or "")
    if answer.status == 200 and (own is None or own < total):
        observed += f" (served by {answer.engine}, limit {own})"
    return expected, observed


def _status(answer: Answer) -> str:
    return f"{answer.status}{' ' + answer.code if answer.code else ''}"


def _expiring(tenant: ProbeTenant) -> bool:
    expires = tenant.key_expires_at
    if expires is None:
        return False
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=UTC)
    return (expires - datetime.now(UTC)).total_seconds() < KEY_RENEW_BEFORE_S


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
