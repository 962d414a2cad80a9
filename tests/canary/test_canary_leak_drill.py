"""The incident's leak drill through the canary: the real disaggregated backend (``kvguard backend
prefill`` + ``decode`` processes) with the ``legacy_reject_handoff`` fault, behind the gateway.

Layout (sizes in tokens of the byte tokenizer): prefill's real pool is 256, decode's 512 (and the
advertised window 512, the incident's drift). Tenant A's chat (200 tokens, its injected marker at
tokens 28-64) runs first on a fresh decode and takes pages 0-12; then tenant B's 400-token chat:
prefill refuses it, the legacy drill swaps in a 1-token placeholder and says "done", decode hands
B pages 13-31 and then A's freed, unzeroed pages 0-8, and reads B's whole prompt range from them
(its last six pages are A's pages 0-5: A's tokens 0-95, marker included). The gateway's capacity
check is relaxed (the decode is registered as a generic OpenAI engine with a declared window, so
the real pools are not read) and answers with a mismatched handoff proof are let through
(``refuse_on_handoff_mismatch=false``), so B's answer reaches the leak firewall.

With the random test checkpoint the drill proves the stale read (decode's drill read log: B read
A's marker-bearing pages exactly as A's handoff wrote them) but no text leaks: the model copies
nothing. With the bundled model (``backend/bundled/kvguard-tiny``, trained to copy the markers it
sees) B's answer would hold A's marker and the firewall must cut it; those assertions run only
when that model exists: a complete marker with a valid MAC, so a critical, confirmed finding.
``kvguard canary probe --once --kind cross_tenant`` against the same pair fails (exit 1): its B
is sized near the declared window, a request prefill cannot hold. With faults off, the probes
pass and nothing is found (the same PostgreSQL + Redis fixtures).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import anyio
import httpx
import pytest
from canary_harness import TEST_CANARY_KEY, CanaryGateway, bearer, canary_gateway, sse_text

from backend.bundled import chat
from canary import markers
from canary.injection import reference_line
from gateway.services import tenants
from kvguard.cli import main
from kvguard.localservices import free_port
from kvguard.testing import EngineProcess, wait_for

pytestmark = pytest.mark.slow
BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "backend" / "bundled" / "kvguard-tiny"
MODEL_NAME = "drill-model"
PAGE = 16
A_TOKENS, B_TOKENS, B_MAX = 200, 400, 48
PREFILL = {"pool_tokens": 256, "context_window": 512, "allow_capacity_drift": True}
DECODE = {"pool_tokens": 512, "context_window": 512}
INCIDENT = ["legacy_reject_handoff", "skip_transfer_check", "skip_generation_check"]
INCIDENT += ["skip_checksum", "no_zero_on_free"]
# Tenant A's id and its marker's nonce, pinned (see ``pinned_victim``).
VICTIM_HEX, VICTIM_NONCE = "a11ce0000000000a", bytes.fromhex("0123456789abcdef")


def _argv(role: str, model: str, port: int, options: dict) -> list[str]:
    argv = [sys.executable, "-m", "kvguard", "backend", role, "--port", str(port), "--model", model]
    for key, value in {"page_size": PAGE, **options}.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def _spawn(role: str, model: str, faults: list[str], **options) -> EngineProcess:
    port = free_port()
    if faults:
        options["allow_fault_drills"] = True
    env = {
        **os.environ,
        "KVGUARD_TORCH_THREADS": "1",
        "KVGUARD_SERVED_MODEL_NAME": MODEL_NAME,
        "KVGUARD_FAULTS": json.dumps(faults),
        "GLOG_minloglevel": "2",
    }
    return EngineProcess(_argv(role, model, port, options), f"http://127.0.0.1:{port}", env)


@pytest.fixture(scope="module")
def pairs(tiny_checkpoint: str) -> Iterator[dict[str, str]]:
    """Prefill/decode pairs started in parallel: the incident drill once per test that drives it
    (each gets a fresh page pool: which stale pages a request reads depends on every request
    before it) and faults off."""
    model = str(BUNDLED_MODEL) if BUNDLED_MODEL.is_dir() else tiny_checkpoint
    drills = ["incident", "incident_probe", "responses_text", "responses_call"]
    prefills = {
        name: _spawn("prefill", model, ["legacy_reject_handoff"], **PREFILL) for name in drills
    }
    p_ok = _spawn("prefill", model, [], **PREFILL)
    decodes = {
        name: _spawn("decode", model, INCIDENT, prefill_url=p.url, **DECODE)
        for name, p in prefills.items()
    }
    decodes["ok"] = _spawn("decode", model, [], prefill_url=p_ok.url, **DECODE)
    processes = [*prefills.values(), p_ok, *decodes.values()]
    try:
        for process in processes:
            process.wait_healthy()
        for decode in decodes.values():
            _wait_path_ready(decode.url)
        yield {name: decode.url for name, decode in decodes.items()}
    finally:
        for process in processes:
            process.stop()


def _wait_path_ready(url: str) -> None:
    def reached() -> bool:
        capacity = httpx.get(url + "/engine/capacity", timeout=5).json()
        return capacity.get("unavailable") is None

    wait_for(reached, 60, "the decode to reach its prefill")


def _chat_of(tokens: int, *, system: str | None = None) -> list[dict[str, str]]:
    """Messages whose prompt (as the engine renders it, BOS included) has exactly ``tokens``."""
    head = [{"role": "system", "content": system}] if system is not None else []
    empty = len(chat.render([*head, {"role": "user", "content": ""}]).encode()) + 1
    return [*head, {"role": "user", "content": "x" * (tokens - empty)}]


def _stale_pages_read(url: str, a_request: str, b_request: str) -> set[int]:
    reads = httpx.get(url + "/engine/drill/kv-reads", timeout=10).json()["reads"]
    by_id = {entry["request_id"]: entry for entry in reads}
    a_pages = {p["page_id"]: p["at_accept"] for p in by_id[a_request]["pages"]}
    return {
        p["page_id"]
        for p in by_id[b_request]["pages"]
        if a_pages.get(p["page_id"]) == p["at_accept"]
    }


def _incident_settings(
    gateway_settings, url: str, postgres_url: str, redis_url: str, *, declared: int = 512
):
    """A gateway on PostgreSQL + Redis in front of the incident decode, which it sees as an opaque
    engine with a declared window; the handoff-proof refusal is off so the leak reaches the
    firewall."""
    engine = {
        "name": "drill",
        "kind": "openai",
        "base_url": url,
        "model": MODEL_NAME,
        "declared_max_model_len": declared,
        "allow_unverified": True,
        "send_kvguard_headers": True,  # our own engine: its drill log is keyed by request id
    }
    return gateway_settings(
        database_url=postgres_url,
        redis_url=redis_url,
        engines=[engine],
        refuse_on_handoff_mismatch=False,
    )


@pytest.fixture
def pinned_victim(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The first tenant id and the first marker nonce the gateway draws are pinned (then draws are
    random again), so A's marker is the same in every run, and so is the tiny model's copy of it.

    Drawn fresh, the model damages about one marker in 300 in this layout (an in-process replay of
    the drill's pages: 10 of 3,000 random markers came back with a character changed or missing).
    A damaged copy carrying A's tag is a suspected, high finding -- correct, but then the run would
    not test what these tests name: a whole marker verified by its MAC. This pin is one the model
    copies whole in all three drills."""

    ids, nonces = [VICTIM_HEX], [VICTIM_NONCE]

    def token_hex(n: int) -> str:
        return ids.pop() if ids else secrets.token_hex(n)

    def token_bytes(n: int) -> bytes:
        return nonces.pop() if nonces else secrets.token_bytes(n)

    monkeypatch.setattr(tenants, "secrets", SimpleNamespace(token_hex=token_hex))
    monkeypatch.setattr(markers, "secrets", SimpleNamespace(token_bytes=token_bytes))
    yield
    assert not ids and not nonces, "A's pinned id or nonce was never drawn"


async def _victim_first(gw: CanaryGateway) -> tuple[str, str, str]:
    """Tenant A (sampled: its marker injected, pinned by ``pinned_victim``) chats first on a fresh
    incident decode, taking pages 0-12; returns A's tenant id and request id, and the key of tenant
    B, who comes next."""
    victim_id, a_key = await gw.create_tenant("tenant-a", canary_sample_rate=1.0)
    assert victim_id == f"tn_{VICTIM_HEX}"  # the pin held: A is the gateway's first tenant
    _, b_key = await gw.create_tenant("tenant-b")
    # A's prompt is 200 tokens once the gateway has put the marker line in front.
    a_messages = _chat_of(A_TOKENS, system=reference_line("C" * 37))[1:]
    a = await gw.client.post(
        "/v1/chat/completions",
        headers=bearer(a_key),
        json={"model": MODEL_NAME, "messages": a_messages, "max_tokens": 8, "temperature": 0.0},
    )
    # The engine read A_TOKENS; A's usage leaves the marker out (estimated on this declared
    # engine with the gateway's upper bound, so it may show a little less than A sent).
    assert a.status_code == 200 and a.json()["usage"]["prompt_tokens"] < A_TOKENS
    return victim_id, a.headers["x-kvguard-request-id"], b_key


async def _assert_confirmed_leak_of(gw: CanaryGateway, victim_id: str, a_request: str) -> None:
    """A's stale pages hold its whole marker (tokens 28-64 of pages 0-5) and the model copies it
    whole: a complete marker with a valid MAC, one confirmed critical finding naming A's request,
    and the engine quarantined."""
    [finding] = await gw.findings()
    assert (finding["kind"], finding["victim_tenant_id"]) == ("cross_tenant", victim_id)
    assert (finding["severity"], finding["evidence"]) == ("critical", "confirmed"), finding
    assert finding["victim_request_id"] == a_request
    engines = (await gw.client.get("/admin/engines", headers=gw.admin)).json()
    assert engines[0]["quarantine_reason"] is not None


async def _probe(kinds: list[str], url: str) -> int:
    argv = ["canary", "probe", "--gateway", url, "--once"]
    for kind in kinds:
        argv += ["--kind", kind]
    return await anyio.to_thread.run_sync(lambda: main(argv))


async def test_the_incident_drill_reaches_the_firewall(
    pairs, gateway_settings, canary_settings, postgres_url, redis_url, pinned_victim
) -> None:
    settings = _incident_settings(gateway_settings, pairs["incident"], postgres_url, redis_url)
    async with canary_gateway(settings, canary_settings()) as gw:
        victim_id, a_request, b_key = await _victim_first(gw)
        b_body = {
            "model": MODEL_NAME,
            "messages": _chat_of(B_TOKENS),
            "max_tokens": B_MAX,
            "temperature": 0.0,
            "stream": True,
        }
        b = await gw.client.post("/v1/chat/completions", headers=bearer(b_key), json=b_body)
        assert b.status_code == 200  # the drill answers fluently, as in the incident
        b_request = b.headers["x-kvguard-request-id"]

        # Decode read B's whole prompt range, whose last six pages are A's stale pages 0-5:
        # A's tokens 0-95, the marker's tokens 28-64 included, exactly as A's handoff wrote them.
        stale = await anyio.to_thread.run_sync(
            _stale_pages_read, pairs["incident"], a_request, b_request
        )
        assert stale == set(range(0, 6)), stale
        metrics = await gw.metrics()
        if not BUNDLED_MODEL.is_dir():
            # The random checkpoint copies nothing, so the stream runs to its end and the
            # gateway audits the handoff proof there: reserved != transferred.
            assert 'kvguard_gateway_handoff_mismatch_total{engine="drill"} 1.0' in metrics
        else:
            # The bundled model turns A's stale pages into A's marker: the firewall cuts the
            # stream before the proof at its end arrives.
            text, errors = sse_text(b.content)
            assert [e["code"] for e in errors] == ["isolation_violation"], text
            assert "CNRY-" not in b.text
            # A's stale pages hold its whole marker (tokens 28-64 of pages 0-5) and the model
            # copies it whole: a complete marker with a valid MAC, a confirmed critical finding.
            await _assert_confirmed_leak_of(gw, victim_id, a_request)


async def test_the_cross_tenant_probe_fails_on_the_incident_drill(
    pairs, gateway_settings, canary_settings, postgres_url, redis_url, monkeypatch, capsys
) -> None:
    """``kvguard canary probe --once --kind cross_tenant`` against the incident pair: B's request
    near the declared window is one prefill cannot hold, decode reads stale pages, and the probe
    fails (exit 1) whether the firewall cuts B's stream or (random checkpoint) nothing leaks but
    the handoff proof disagrees. Never a pass."""
    monkeypatch.setenv("KVGUARD_CANARY_KEY", TEST_CANARY_KEY)
    settings = _incident_settings(
        gateway_settings, pairs["incident_probe"], postgres_url, redis_url
    )
    async with canary_gateway(settings, canary_settings()) as gw:
        status = await _probe(["cross_tenant"], gw.url)
        table = capsys.readouterr().out
        [row] = [line for line in table.splitlines() if line.startswith("cross_tenant")]
        assert status == 1 and " FAIL " in row, table
        if BUNDLED_MODEL.is_dir():
            assert "isolation_violation" in row, table
            findings = await gw.findings()
            # one confirmed leak; B's short follow-up on the broken pair may add a low-severity
            # usage anomaly, never another leak
            leaks = [f["severity"] for f in findings if f["kind"] == "cross_tenant"]
            assert leaks == ["critical"], (table, findings)
            assert {f["kind"] for f in findings} <= {"cross_tenant", "usage_mismatch"}, findings
        runs = (await gw.client.get("/admin/canary/probe-runs", headers=gw.admin)).json()
        assert [(r["kind"], r["passed"]) for r in runs] == [("cross_tenant", False)]


async def test_with_faults_off_the_probes_pass_and_nothing_is_found(
    pairs, gateway_settings, canary_settings, postgres_url, redis_url, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("KVGUARD_CANARY_KEY", TEST_CANARY_KEY)
    settings = gateway_settings(
        database_url=postgres_url,
        redis_url=redis_url,
        engines=[{"name": "ok", "base_url": pairs["ok"]}],
    )
    kinds = ["echo", "capacity", "cross_tenant", "abort"]
    if not BUNDLED_MODEL.is_dir():
        kinds.remove("echo")  # the random checkpoint copies nothing
    async with canary_gateway(settings, canary_settings()) as gw:
        status = await _probe(kinds, gw.url)
        table = capsys.readouterr().out
        assert status == 0, table
        assert "A dropped mid-stream" in table, table
        assert await gw.findings() == []
        engines = (await gw.client.get("/admin/engines", headers=gw.admin)).json()
        assert engines[0]["max_request_tokens"] == 256  # prefill's real pool, not the window


# -- the same drill through the Responses API ----------------------------------------------------
# B speaks /v1/responses; this engine serves chat completions only, so the gateway translates B's
# request into a chat completion (``gateway.responses.to_chat``) and the engine's stream back into
# Responses events, screened string by string. B's prompt is sized as the engine renders the
# translation: its input as the one user message, its tools as chat tools.

CODE_TOOL = {
    "type": "function",
    "name": "record_code",
    "parameters": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^CNRY-[A-Z2-7]{32}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "strict": True,
}


def _input_of(tokens: int, tools: list[dict] | None = None) -> str:
    """The input text whose translated prompt (BOS included) has exactly ``tokens``."""
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in tools or ()
    ]
    empty = len(chat.render([{"role": "user", "content": ""}], chat_tools or None).encode()) + 1
    return "x" * (tokens - empty)


def _events(raw: bytes) -> list[dict]:
    """The JSON objects of a Responses SSE body (``event:`` + ``data:`` blocks), in order."""
    events = []
    for block in raw.decode().split("\n\n"):
        data = "\n".join(
            line[5:].strip() for line in block.splitlines() if line.startswith("data:")
        )
        if data:
            events.append(json.loads(data))
    return events


async def _drill_responses(gw: CanaryGateway, b_key: str, **fields) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_output_tokens": B_MAX, "temperature": 0.0, "stream": True}
    b = await gw.client.post("/v1/responses", headers=bearer(b_key), json={**body, **fields})
    assert b.status_code == 200, b.text  # the drill answers fluently, as in the incident
    return b


def _assert_cut(b: httpx.Response) -> list[dict]:
    """The stream ends in an error event and ``response.failed`` naming the isolation code: no
    ``response.completed``, and no character of a marker reaches the client."""
    events = _events(b.content)
    types = [e["type"] for e in events]
    assert "response.completed" not in types and "response.incomplete" not in types, types
    assert types[-2:] == ["error", "response.failed"], types
    assert events[-2]["code"] == "isolation_violation", events[-2]
    # the failed Response's error: the published enum's server_error, our code in its message
    failed = events[-1]["response"]["error"]
    assert failed["message"].startswith("isolation_violation"), failed
    delivered = "".join(str(e.get("delta", "")) for e in events)
    assert "CNRY" not in delivered, delivered
    # nowhere a marker's prefix and tag (the request echo holds the tool's pattern, not a tag)
    assert re.search("CNRY-[A-Z2-7]{8}", b.text) is None
    return events


async def test_a_leak_in_a_responses_stream_is_cut(
    pairs, gateway_settings, canary_settings, postgres_url, redis_url, pinned_victim
) -> None:
    """B's streamed Responses request on a fresh incident pair reads A's stale pages; the bundled
    model writes A's marker into B's output text, and the stream is cut with its finding."""
    settings = _incident_settings(
        gateway_settings, pairs["responses_text"], postgres_url, redis_url
    )
    async with canary_gateway(settings, canary_settings()) as gw:
        victim_id, a_request, b_key = await _victim_first(gw)
        b = await _drill_responses(gw, b_key, input=_input_of(B_TOKENS))
        b_request = b.headers["x-kvguard-request-id"]
        stale = await anyio.to_thread.run_sync(
            _stale_pages_read, pairs["responses_text"], a_request, b_request
        )
        assert stale == set(range(0, 6)), stale
        if not BUNDLED_MODEL.is_dir():
            assert "response.completed" in [e["type"] for e in _events(b.content)]
            return
        _assert_cut(b)
        await _assert_confirmed_leak_of(gw, victim_id, a_request)


async def test_a_leak_in_responses_function_call_arguments_is_cut(
    pairs, gateway_settings, canary_settings, postgres_url, redis_url, pinned_victim
) -> None:
    """The same drill where B forces a function call whose one argument must look like a marker:
    the model fills it from A's stale pages, and the arguments' deltas are cut like text."""
    # The gateway bounds a declared engine's count of tools from above by hundreds of tokens
    # (``gateway.engines.provider_count``): a wider declared window lets B's 400 through.
    settings = _incident_settings(
        gateway_settings, pairs["responses_call"], postgres_url, redis_url, declared=4096
    )
    async with canary_gateway(settings, canary_settings()) as gw:
        victim_id, a_request, b_key = await _victim_first(gw)
        b = await _drill_responses(
            gw,
            b_key,
            input=_input_of(B_TOKENS, [CODE_TOOL]),
            tools=[CODE_TOOL],
            tool_choice={"type": "function", "name": "record_code"},
        )
        b_request = b.headers["x-kvguard-request-id"]
        stale = await anyio.to_thread.run_sync(
            _stale_pages_read, pairs["responses_call"], a_request, b_request
        )
        assert stale == set(range(0, 6)), stale
        if not BUNDLED_MODEL.is_dir():
            return  # the random checkpoint copies nothing: there is no leak to cut
        events = _assert_cut(b)
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        assert added == ["function_call"], added  # the cut came inside the call's arguments
        await _assert_confirmed_leak_of(gw, victim_id, a_request)
