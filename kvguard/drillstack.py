"""The drill stack: the incident's deployment and a guarded one, as local processes, and the two
tenants' requests that replay the leak (used by ``kvguard demo`` and the operations tests).

Lifecycle: ``drill_stack`` lays out the processes on free ports (nothing starts) -> ``running``
starts them all at once (role logs to files), waits until each answers /health and the gateway
routes to both engines, and stops them all at exit -> ``play`` sends tenant A's marked chat, then
tenant B's over-long streamed chat, to one engine -> ``finding_for`` / ``quarantine_of`` read
what the canary recorded through the admin API.

The engines (sizes in tokens of the bundled model's byte tokenizer, page size 16):

- ``drill``: the incident's deployment. Prefill's real KV pool is 256 tokens but it advertises a
  512-token window, and it runs the ``legacy_reject_handoff`` drill (a rejected prompt becomes a
  1-token placeholder and the handoff says "done"). Decode (512-token pool) admits against its
  own pool only, skips the reserved-vs-transferred, generation and checksum checks and does not
  zero freed pages. The gateway knows it only as an opaque OpenAI-compatible engine with a
  declared 512-token window, and lets answers with a mismatched handoff proof through: only the
  canary firewall stands.
- ``guarded``: the bundled engine with the same drift (window 512 > pool 256) and no drill; the
  gateway reads its real pool and enforces it.
- ``proof`` (optional, the operations tests): a prefill/decode pair in production mode where
  prefill was left running ``legacy_reject_handoff`` but decode keeps every check (it admits
  against its own pool, as in the drill). An over-long prompt sent straight to it is refused by
  decode's reserved-vs-transferred check, and prefill's slow link (a drill setting) leaves time to
  abort a request mid-transfer. The gateway does not route to it: the Handoff health dashboard
  and the handoff-proof and fault-drill alerts are what it lights.

On ``drill``, A's 200-token chat (its marker included) fills pages 0-12 of a fresh decode; B's
400 tokens fit the window but not prefill's pool, and decode reads B's prompt range from pages
that include A's stale pages 0-5 (``tests/canary/test_canary_leak_drill.py`` walks through the
layout). The bundled model copies the marker it sees there, so the firewall must cut B's stream.
On ``guarded`` the same B is refused with ``context_length_exceeded``. Results hold ids, codes
and sizes only: no prompt, answer or marker text.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvguard.load.content import MARKER_RE as _MARKER

if TYPE_CHECKING:
    import httpx

DRILL, GUARDED = "drill", "guarded"
DRILL_MODEL, GUARDED_MODEL = "kvguard-tiny-drill", "kvguard-tiny"
PAGE = 16
A_TOKENS, A_MAX = 200, 8
B_TOKENS, B_MAX = 400, 48
WINDOW, PREFILL_POOL, DECODE_POOL = 512, 256, 512
PREFILL_FAULTS = ("legacy_reject_handoff",)
# Decode's side of the legacy drill: admit against its own pool only (prefill's is unseen).
DECODE_FAULTS = (
    "legacy_reject_handoff",
    "skip_transfer_check",
    "skip_generation_check",
    "skip_checksum",
    "no_zero_on_free",
)
PROOF = "proof"
# The proof pair's decode admits against its own pool only and keeps every check.
PROOF_FAULTS = ("legacy_reject_handoff",)
PROOF_LINK_BYTES_PER_S = 100_000  # the tiny model's page is 8 KiB: a 200-token prompt takes ~1 s
CUT_CODE = "isolation_violation"
REFUSED_CODE = "context_length_exceeded"


class StackFailed(RuntimeError):
    """A role of the drill stack died or never became ready (the message names its log)."""


@dataclass(frozen=True, slots=True)
class Role:
    """One local process of the drill stack."""

    name: str
    argv: list[str]
    url: str
    env: dict[str, str] = field(repr=False)  # the gateway's holds the stack's secrets


@dataclass(frozen=True, slots=True)
class DrillStack:
    gateway: str
    drill_prefill: str
    drill_decode: str
    guarded: str
    roles: tuple[Role, ...]  # the gateway last
    admin_token: str = field(repr=False)  # fresh per stack, never a development default
    canary_key: str = field(repr=False)
    engine_token: str = field(repr=False)  # every engine takes calls only with it
    proof_prefill: str | None = None
    proof_decode: str | None = None

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def engine_auth(self) -> dict[str, str]:
        """What a caller of an engine itself presents (the gateway does so on its own)."""
        return {"Authorization": f"Bearer {self.engine_token}"}


def _engine_argv(role: str, port: int, model: Path | None, *flags: str) -> list[str]:
    argv = [sys.executable, "-m", "kvguard", "backend", role, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--page-size", str(PAGE), *flags]
    return argv + (["--model", str(model)] if model is not None else [])


def _faults(names: tuple[str, ...]) -> list[str]:
    return ["--allow-fault-drills", *(f"--fault={name}" for name in names)]


def engine_specs(drill_decode: str, guarded: str, engine_token: str) -> list[dict[str, Any]]:
    """The gateway's engines: the drill as an opaque provider (its key is the engine credential),
    the guarded one introspected (presenting the gateway's KVGUARD_ENGINE_TOKEN)."""
    opaque: dict[str, Any] = {"name": DRILL, "kind": "openai", "base_url": drill_decode}
    opaque |= {"model": DRILL_MODEL, "declared_max_model_len": WINDOW, "allow_unverified": True}
    opaque["api_key"] = engine_token
    return [opaque, {"name": GUARDED, "kind": "bundled", "base_url": guarded}]


def _proof_roles(
    port: dict[str, int], env: dict[str, str], model: Path | None
) -> tuple[Role, Role]:
    proof_env = {**env, "KVGUARD_MODE": "production", "KVGUARD_SERVED_MODEL_NAME": DRILL_MODEL}
    proof_env["KVGUARD_DECODE_PEERS"] = json.dumps(["127.0.0.1"])  # decode's transfer host
    # one host: the loopback transport, bound to 127.0.0.1 (production refuses Mooncake's
    # every-interface listeners unless asked for them)
    proof_env["KVGUARD_TRANSPORT"] = "loopback"
    drift = ["--context-window", str(WINDOW), "--allow-capacity-drift"]
    prefill = _engine_argv("prefill", port["proof-prefill"], model, *_faults(PROOF_FAULTS))
    prefill += ["--pool-tokens", str(PREFILL_POOL), *drift]
    prefill_url = f"http://127.0.0.1:{port['proof-prefill']}"
    decode = _engine_argv("decode", port["proof-decode"], model, *_faults(PROOF_FAULTS))
    decode += ["--pool-tokens", str(DECODE_POOL), "--context-window", str(WINDOW)]
    decode += ["--prefill-url", prefill_url]
    slow = {**proof_env, "KVGUARD_DRILL_LINK_BYTES_PER_S": str(PROOF_LINK_BYTES_PER_S)}
    return (
        Role("proof-prefill", prefill, prefill_url, slow),
        Role("proof-decode", decode, f"http://127.0.0.1:{port['proof-decode']}", proof_env),
    )


def drill_stack(
    data_dir: Path, env: dict[str, str], *, model: Path | None = None, proof: bool = False
) -> DrillStack:
    """The processes of the drill stack on free ports (nothing is started here); ``proof`` adds
    the proof pair."""
    from kvguard.localservices import free_port

    names = ["prefill", "decode", "guarded", "gateway"]
    names += ["proof-prefill", "proof-decode"] if proof else []
    port = {name: free_port() for name in names}
    url = {name: f"http://127.0.0.1:{p}" for name, p in port.items()}
    engine_token = secrets.token_urlsafe(32)
    engine_env = {**env, "KVGUARD_TORCH_THREADS": "1", "GLOG_minloglevel": "2"}
    engine_env["KVGUARD_ENGINE_TOKEN"] = engine_token
    drill_env = {**engine_env, "KVGUARD_SERVED_MODEL_NAME": DRILL_MODEL}
    guarded_env = {**engine_env, "KVGUARD_SERVED_MODEL_NAME": GUARDED_MODEL}
    drift = ["--context-window", str(WINDOW), "--allow-capacity-drift"]
    small = ["--pool-tokens", str(PREFILL_POOL), *drift]
    prefill = _engine_argv("prefill", port["prefill"], model, *small, *_faults(PREFILL_FAULTS))
    decode = _engine_argv("decode", port["decode"], model, "--pool-tokens", str(DECODE_POOL))
    decode += ["--context-window", str(WINDOW), "--prefill-url", url["prefill"]]
    decode += _faults(DECODE_FAULTS)
    guarded = _engine_argv("unified", port["guarded"], model, *small)
    admin_token, canary_key = secrets.token_urlsafe(32), secrets.token_urlsafe(48)
    gateway_env = {
        **env,
        "KVGUARD_ADMIN_TOKEN": admin_token,
        "KVGUARD_CANARY_KEY": canary_key,
        "KVGUARD_DATA_DIR": str(data_dir),
        "KVGUARD_ENGINE_TOKEN": engine_token,
        "KVGUARD_ENGINES": json.dumps(engine_specs(url["decode"], url["guarded"], engine_token)),
        "KVGUARD_REFUSE_ON_HANDOFF_MISMATCH": "false",  # the incident's gateway trusted "done"
        "KVGUARD_POLL_INTERVAL_S": "0.5",
        "KVGUARD_CAPACITY_STALE_AFTER_S": "10",
    }
    gateway = [sys.executable, "-m", "kvguard", "gateway", "--host", "127.0.0.1"]
    gateway += ["--port", str(port["gateway"]), "--log-level", "warning"]
    extra = _proof_roles(port, engine_env, model) if proof else ()
    roles = (
        Role("drill-prefill", prefill, url["prefill"], drill_env),
        Role("drill-decode", decode, url["decode"], drill_env),
        Role("guarded", guarded, url["guarded"], guarded_env),
        *extra,
        Role("gateway", gateway, url["gateway"], gateway_env),
    )
    return DrillStack(
        url["gateway"],
        url["prefill"],
        url["decode"],
        url["guarded"],
        roles,
        admin_token,
        canary_key,
        engine_token,
        url.get("proof-prefill"),
        url.get("proof-decode"),
    )


# -- running the stack -----------------------------------------------------------------------------


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def routable(gateway: str, admin: dict[str, str]) -> set[str]:
    """Names of the engines the gateway routes to now."""
    import httpx

    try:
        r = httpx.get(gateway + "/admin/engines", headers=admin, timeout=5)
        engines = r.json() if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return set()
    return {e["name"] for e in engines if e.get("routable")}


Watched = list[tuple[Role, "subprocess.Popen[bytes]", Path]]


def _wait(check: Callable[[], bool], what: str, watched: Watched, deadline: float) -> None:
    while not check():
        for role, proc, log in watched:
            if proc.poll() is not None:
                raise StackFailed(f"{role.name} exited with {proc.returncode} (log: {log})")
        if time.monotonic() > deadline:
            raise StackFailed(f"{what} not ready in time (logs: {watched[0][2].parent})")
        time.sleep(0.2)


@contextmanager
def running(stack: DrillStack, log_dir: Path, *, timeout_s: float = 240.0) -> Iterator[None]:
    """Start every role at once (they load in parallel), wait until the gateway routes to both
    engines, stop everything at the end (SIGTERM, then SIGKILL after 15 s)."""
    watched: Watched = []
    try:
        for role in stack.roles:
            log = log_dir / f"{role.name}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(role.argv, env=role.env, stdout=out, stderr=out)
            watched.append((role, proc, log))
        deadline = time.monotonic() + timeout_s
        for role in stack.roles:
            health = role.url + "/health"
            _wait(lambda: _answers(health), role.name, watched, deadline)  # noqa: B023 (used now)
        both = {DRILL, GUARDED}
        _wait(lambda: routable(stack.gateway, stack.admin()) >= both, "routing", watched, deadline)
        yield
    finally:
        for _, proc, _ in reversed(watched):
            if proc.poll() is None:
                proc.terminate()
        for _, proc, _ in reversed(watched):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- the two tenants' requests ---------------------------------------------------------------------


def chat_of(tokens: int, *, system: str | None = None) -> list[dict[str, str]]:
    """Messages whose prompt (as the bundled engine renders it, BOS included) has ``tokens``."""
    from backend.bundled import chat

    head = [{"role": "system", "content": system}] if system is not None else []
    empty = len(chat.render([*head, {"role": "user", "content": ""}]).encode()) + 1
    return [*head, {"role": "user", "content": "x" * (tokens - empty)}]


def a_messages() -> list[dict[str, str]]:
    """Tenant A's chat: 200 tokens once the gateway has put its marker line in front."""
    from canary.injection import reference_line
    from canary.markers import MARKER_CHARS

    return chat_of(A_TOKENS, system=reference_line("C" * MARKER_CHARS))[1:]


@dataclass(frozen=True, slots=True)
class Exchange:
    """What a tenant got back: status, request id, error codes, and how much text (no text)."""

    status: int
    request_id: str | None
    codes: tuple[str, ...]
    text_chars: int
    marker_seen: bool  # a whole canary marker reached the client
    prompt_tokens: int | None = None

    def outcome(self) -> str:
        if self.status != 200:
            return f"{self.status} {' '.join(self.codes)}".strip()
        if self.codes:
            return f"200, stream cut: {' '.join(self.codes)}"
        return "200"


def _sse(raw: str) -> tuple[str, list[str]]:
    text, codes = [], []
    for block in raw.split("\n\n"):
        data = "\n".join(
            line[5:].strip() for line in block.splitlines() if line.startswith("data:")
        )
        if not data or data == "[DONE]":
            continue
        obj = json.loads(data)
        if isinstance(obj.get("error"), dict):
            codes.append(str(obj["error"].get("code")))
        for choice in obj.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text), codes


def send(
    client: httpx.Client, key: str, model: str, messages: list[dict[str, str]], **extra: Any
) -> Exchange:
    body = {"model": model, "messages": messages, "temperature": 0.0, **extra}
    r = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    request_id = r.headers.get("x-kvguard-request-id")
    if r.status_code == 200 and extra.get("stream"):
        text, events = _sse(r.text)
        return Exchange(200, request_id, tuple(events), len(text), bool(_MARKER.search(r.text)))
    data = r.json()
    error = data.get("error") if isinstance(data.get("error"), dict) else None
    codes = (str(error.get("code")),) if error else ()
    text = "" if error else str(data["choices"][0]["message"].get("content") or "")
    prompt = (data.get("usage") or {}).get("prompt_tokens")
    return Exchange(
        r.status_code, request_id, codes, len(text), bool(_MARKER.search(r.text)), prompt
    )


@dataclass(frozen=True, slots=True)
class Act:
    engine: str
    a: Exchange
    b: Exchange


def play(client: httpx.Client, engine: str, model: str, key_a: str, key_b: str) -> Act:
    """Tenant A's marked chat, then tenant B's over-long streamed chat, on one engine."""
    a = send(client, key_a, model, a_messages(), max_tokens=A_MAX)
    b = send(client, key_b, model, chat_of(B_TOKENS), max_tokens=B_MAX, stream=True)
    return Act(engine, a, b)


def create_tenant(
    client: httpx.Client, admin: dict[str, str], name: str, *, sample_rate: float = 0.0
) -> tuple[str, str]:
    """(tenant id, key) through the admin API."""
    body = {"name": name, "canary_sample_rate": sample_rate}
    r = client.post("/admin/tenants", json=body, headers=admin)
    r.raise_for_status()
    return r.json()["tenant"]["id"], r.json()["key"]["key"]


def finding_for(
    client: httpx.Client, admin: dict[str, str], request_id: str | None
) -> dict[str, Any] | None:
    """The finding the firewall stored for the request it cut."""
    r = client.get("/admin/canary/findings", headers=admin)
    r.raise_for_status()
    found = [f for f in r.json() if request_id and f.get("observer_request_id") == request_id]
    return found[0] if found else None


def quarantine_of(client: httpx.Client, admin: dict[str, str], engine: str) -> str | None:
    r = client.get("/admin/engines", headers=admin)
    r.raise_for_status()
    reasons = [e.get("quarantine_reason") for e in r.json() if e["name"] == engine]
    return reasons[0] if reasons else None
