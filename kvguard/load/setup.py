"""Before the load: tenants with their own keys, the model's real limit, calibrated prompt sizes.

Lifecycle (``prepare``), all through the gateway's public and admin APIs:

1. Tenants ``<prefix>-0 .. <prefix>-(K-1)``: created synthetic with canary sample rate 0 through
   ``POST /admin/tenants``, or, when they exist and are synthetic, given a fresh key that expires
   after the run (a non-synthetic tenant of that name is never used).
2. The model and its limit: ``GET /v1/models`` as the first tenant; ``max_model_len`` there is the
   smallest real limit on the tenant's path, which the gateway enforces.
3. Calibration: the prompt is the bundled model's echo contract (``Reference code: <marker>``,
   filler, ``Repeat the reference code.``). Short non-streamed requests (``max_tokens`` 1) read the
   engine's own count of the prompt (``usage.prompt_tokens``) with no filler (three fresh markers:
   their spread is the slack a BPE tokenizer needs) and with a known filler, then fit the filler
   that makes the mid and the near-limit prompts. The near class gets exactly the remaining
   ``max_tokens`` (``prompt + max_tokens == limit``, minus the slack); the over class is the same
   prompt with one token more than fits (plus the slack). The over_prompt class is the incident's
   case: a prompt that alone exceeds the limit (by ``ANSWER_TOKENS`` plus the slack, with
   ``max_tokens`` 1). The gateway refuses it, so its size cannot be measured: its filler is
   extrapolated from the near prompt with the measured tokens per filler character, and its
   ``prompt_tokens`` is that estimate. Both over classes expect 400 ``context_length_exceeded``.
   The opt-in foreign class is the short prompt carrying another load tenant's marker: 400
   ``foreign_canary_marker`` at the door.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import httpx

from canary.markers import MARKER_CHARS, MarkerCodec
from canary.probes import filler_text, reference_chat
from kvguard.load.content import CONTEXT_LENGTH_EXCEEDED, FOREIGN_CANARY_MARKER, error_code
from kvguard.load.plan import LoadTenant, SizeClass

ANSWER_TOKENS = MARKER_CHARS + 8  # room for the echoed marker and the end of the answer
MARKER_SAMPLES = 3
FIT_ROUNDS = 6


class LoadSetupError(RuntimeError):
    """The run cannot start (gateway unreachable, admin token refused, no model, tiny limit)."""


@dataclass(frozen=True, slots=True)
class Calibration:
    sizes: tuple[SizeClass, ...]
    slack: int
    byte_tokens: bool


class GatewaySetup:
    """The admin and tenant calls of the set-up, over one ``httpx.Client``."""

    def __init__(self, http: httpx.Client, *, admin_token: str) -> None:
        self.http = http
        self._admin = {"Authorization": f"Bearer {admin_token}"}

    def ensure_tenant(self, name: str, *, key_lifetime_s: int) -> LoadTenant:
        r = self.http.get(f"/admin/tenants/{name}", headers=self._admin)
        if r.status_code == 404:
            body = {
                "name": name,
                "synthetic": True,
                "canary_sample_rate": 0.0,
                "key_name": "kvguard-load",
                "key_expires_in_s": key_lifetime_s,
            }
            created = self.http.post("/admin/tenants", json=body, headers=self._admin)
            _expect(created, 201, f"create tenant {name}")
            data = created.json()
            return LoadTenant(id=data["tenant"]["id"], name=name, key=data["key"]["key"])
        _expect(r, 200, f"read tenant {name}")
        tenant = r.json()
        if not tenant.get("synthetic"):
            raise LoadSetupError(f"tenant {name!r} exists and is not synthetic; refusing to use it")
        body = {"name": "kvguard-load", "expires_in_s": key_lifetime_s}
        issued = self.http.post(f"/admin/tenants/{name}/keys", json=body, headers=self._admin)
        _expect(issued, 201, f"issue a key for {name}")
        return LoadTenant(id=tenant["id"], name=name, key=issued.json()["key"])

    def model_limit(self, tenant: LoadTenant, model: str | None) -> tuple[str, int]:
        """(model, max_model_len) from the gateway's ``GET /v1/models`` for this tenant."""
        r = self.http.get("/v1/models", headers=_bearer(tenant))
        _expect(r, 200, "list models")
        cards = [c for c in r.json().get("data") or [] if model is None or c.get("id") == model]
        if not cards:
            raise LoadSetupError(f"the gateway serves {'no model' if model is None else model}")
        limit = cards[0].get("max_model_len")
        if not isinstance(limit, int) or limit <= 0:
            raise LoadSetupError(f"model {cards[0].get('id')!r} reports no max_model_len")
        return str(cards[0]["id"]), limit

    def prompt_tokens(
        self, tenant: LoadTenant, codec: MarkerCodec, model: str, filler_chars: int
    ) -> int:
        """The engine's count of the load prompt with this much filler (one 1-token answer)."""
        marker = codec.issue(tenant.id)
        body = {
            "model": model,
            "messages": reference_chat(marker, filler=filler_text(filler_chars)),
            "max_tokens": 1,
            "temperature": 0.0,
        }
        r = self.http.post("/v1/chat/completions", json=body, headers=_bearer(tenant))
        if r.status_code != 200:
            raise LoadSetupError(
                f"calibration request ({filler_chars} filler chars) answered {r.status_code} "
                f"{error_code(r.content) or ''}".rstrip()
            )
        tokens = (r.json().get("usage") or {}).get("prompt_tokens")
        if not isinstance(tokens, int) or tokens <= 0:
            raise LoadSetupError("calibration answer has no usage.prompt_tokens")
        return tokens


def calibrate(
    gateway: GatewaySetup, tenant: LoadTenant, codec: MarkerCodec, model: str, limit: int
) -> Calibration:
    counts = [gateway.prompt_tokens(tenant, codec, model, 0) for _ in range(MARKER_SAMPLES)]
    base, slack = max(counts), max(counts) - min(counts)
    if base + 2 * (ANSWER_TOKENS + slack) + 1 > limit:
        raise LoadSetupError(f"a limit of {limit} tokens leaves no room for the load prompts")
    probe_chars = max(64, (limit - base) // 4)
    probed = gateway.prompt_tokens(tenant, codec, model, probe_chars)
    per_char = (probed - base) / max(1, len(filler_text(probe_chars)) + 1)
    if per_char <= 0:
        raise LoadSetupError("the filler adds no prompt tokens; cannot size prompts")
    byte_tokens = slack == 0 and probed - base == len(filler_text(probe_chars)) + 1

    def fit(target: int) -> tuple[int, int]:
        """(filler chars, prompt tokens) of the largest fitted prompt not above ``target``."""
        tolerance = max(1, math.ceil(1 / per_char))
        chars = max(0, int((target - base) / per_char))
        best: tuple[int, int] | None = None
        for _ in range(FIT_ROUNDS):
            tokens = gateway.prompt_tokens(tenant, codec, model, chars)
            if tokens <= target and (best is None or tokens > best[1]):
                best = (chars, tokens)
            if tokens <= target and target - tokens <= tolerance:
                break
            step = max(1, math.floor(abs(target - tokens) / per_char))
            chars = max(0, chars - step if tokens > target else chars + step)
        if best is None:
            raise LoadSetupError(f"could not fit a prompt of at most {target} tokens")
        return best

    mid_chars, mid_tokens = fit(limit // 2)
    near_chars, near_tokens = fit(limit - ANSWER_TOKENS - slack)
    near_room = limit - near_tokens - slack
    over_chars = near_chars + math.ceil((limit + ANSWER_TOKENS + slack - near_tokens) / per_char)
    over_tokens = near_tokens + math.floor((over_chars - near_chars) * per_char)
    sizes = (
        SizeClass("short", 0, ANSWER_TOKENS, base, 200),
        SizeClass("mid", mid_chars, ANSWER_TOKENS, mid_tokens, 200),
        SizeClass("near", near_chars, near_room, near_tokens, 200),
        SizeClass(
            "over", near_chars, near_room + 2 * slack + 1, near_tokens, 400, CONTEXT_LENGTH_EXCEEDED
        ),
        SizeClass("over_prompt", over_chars, 1, over_tokens, 400, CONTEXT_LENGTH_EXCEEDED),
        SizeClass("foreign", 0, ANSWER_TOKENS, base, 400, FOREIGN_CANARY_MARKER),
    )
    return Calibration(sizes=sizes, slack=slack, byte_tokens=byte_tokens)


def _bearer(tenant: LoadTenant) -> dict[str, str]:
    return {"Authorization": f"Bearer {tenant.key}"}


def _expect(r: httpx.Response, status: int, what: str) -> None:
    if r.status_code != status:
        raise LoadSetupError(f"{what}: HTTP {r.status_code} {error_code(r.content) or ''}".rstrip())


def describe(sizes: tuple[SizeClass, ...], limit: int) -> list[dict[str, Any]]:
    """The size classes as the summary shows them (no secrets in them)."""
    return [
        {
            "name": s.name,
            "prompt_tokens": s.prompt_tokens,
            "max_tokens": s.max_tokens,
            "total_tokens": s.total_tokens,
            "limit": limit,
            "expected": f"{s.expected_status}{' ' + s.expected_code if s.expected_code else ''}",
        }
        for s in sizes
    ]
