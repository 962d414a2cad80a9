"""The KV transfer channel, attacked by a peer of the transfer port that holds no ticket.

Attacker: any process on the engines' network, or any local user under ``kvguard up --profile
production-like``, that reads this code. It used to list decode's whole KV pool with one Mooncake
handshake, read another tenant's prompt out of layer 0's pages, write chosen K/V into live pages
(attacker words in the victim's 200), and -- holding the engine credential -- have prefill write a
request's KV into its own memory (any port of a decode peer's host).

Proves, against a production-mode prefill/decode pair (engine credential, decode peers set) over
Mooncake TCP and over the loopback transport, real processes on 127.0.0.1:

- at rest a handshake finds nothing registered on either role; the loopback transfer port listens
  on 127.0.0.1 only (Mooncake's listen on every interface, which production makes the deployment
  ask for);
- during a transfer only that handoff's landing slots are registered (sized to it, withdrawn at
  its end), and all a Mooncake read of them finds is ciphertext;
- writes into them while the transfer runs either change nothing (the answer is the honest one)
  or fail that request closed -- 502 ``kv_handoff_refused`` with check ``seal``, a metric, a log
  line naming the request -- and the next request is served: nothing is quarantined;
- prefill refuses (403), even with the credential, a target that is not exactly what a decode
  announced: another port of the decode's host, another instance, another memory range;
- production refuses the open channel and an unasked Mooncake bind, in one line each.

Controls: the attacker's reads return the landed bytes (so it would see plaintext if there were
any), its test for KV tells float32 KV from the same KV sealed, and its writes reached registered
slots in every attack. The open channel (the channel as it was, development only) is attacked in
``tests/backend/verify`` (counterexamples 11 and 12) and ``tests/backend/disagg``.

Prefill runs a slow-link drill (each batch spends ~0.1 s "on the wire") so that a transfer lasts
about a second: long enough to attack in the middle, deterministically. It changes timing only.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from kv_attacker import (
    Buffer,
    MooncakePeer,
    Role,
    kv_like_bytes,
    listening_host,
    looks_like_kv,
    loopback_write,
    segment,
)

from backend.config import BackendSettings
from backend.disagg.protocol import PROTOCOL_VERSION
from backend.disagg.seal import OVERHEAD, Seal
from backend.disagg.seal import new_key as new_seal_key
from backend.server.roles import make_transport
from canary.config import new_key
from kvguard.cli import main
from kvguard.testing import wait_for

TOKEN = new_key()
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PAGE = 16
PROMPT_TOKENS = 160  # 10 pages: 10 batches of one page on the slow link
SECONDS_PER_PAGE = 0.1
DECODE_LOG = (
    r"decode instance (?P<instance>\w+): transfer endpoint (?P<endpoint>\S+), sealed channel, "
    r"(?P<slots>\d+) landing slots of (?P<slot_bytes>\d+) bytes at (?P<base>0x[0-9a-f]+)"
)


def _slot_bytes(checkpoint: str) -> int:
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    token = config["num_key_value_heads"] * config["head_dim"] * 4  # float32
    return 2 * config["num_hidden_layers"] * PAGE * token + OVERHEAD


@dataclass
class Pair:
    transport: str
    prefill: Role
    decode: Role
    honest: dict[str, str]  # prompt -> the answer without an attacker

    def target(self) -> dict[str, Any]:
        found = self.decode.logged(DECODE_LOG)
        return {
            "instance": found["instance"],
            "endpoint": found["endpoint"],
            "slots": int(found["slots"]),
            "slot_bytes": int(found["slot_bytes"]),
            "base": int(found["base"], 16),
        }

    def mooncake_endpoint(self, role: Role) -> str:
        return role.logged(r"Mooncake transfer engine at (\S+) ")[1]

    def ask(self, prompt: str, request_id: str) -> httpx.Response:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        headers = {**AUTH, "X-Kvguard-Request-Id": request_id, "X-Kvguard-Tenant": "victim"}
        return httpx.post(
            self.decode.url + "/v1/completions", json=body, headers=headers, timeout=60
        )

    def honest_answer(self, prompt: str) -> str:
        if prompt not in self.honest:
            answer = self.ask(prompt, f"honest-{len(self.honest)}")
            assert answer.status_code == 200, answer.text
            self.honest[prompt] = answer.json()["choices"][0]["text"]
        return self.honest[prompt]

    def metric(self, name: str, **labels: str) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in httpx.get(self.decode.url + "/metrics", timeout=10).text.splitlines():
            sample, _, value = line.rpartition(" ")
            if sample == (f"{name}{{{want}}}" if want else name):
                return float(value)
        return 0.0

    def capacity(self) -> dict[str, Any]:
        return httpx.get(self.decode.url + "/engine/capacity", headers=AUTH, timeout=10).json()


def _roles(transport: str, slot_bytes: int) -> tuple[Role, Role]:
    common = {
        "KVGUARD_ENGINE_TOKEN": TOKEN,
        "KVGUARD_SERVED_MODEL_NAME": "tiny",
        "KVGUARD_TRANSPORT": transport,
        "KVGUARD_MODE": "production",
    }
    if transport == "mooncake":
        common["KVGUARD_TRANSFER_BIND"] = "0.0.0.0"  # what Mooncake does: asked for
    prefill = Role(
        "prefill",
        {
            **common,
            "KVGUARD_DECODE_PEERS": '["127.0.0.1"]',
            "KVGUARD_ALLOW_FAULT_DRILLS": "true",
            "KVGUARD_DRILL_LINK_BYTES_PER_S": str(int(slot_bytes / SECONDS_PER_PAGE)),
        },
        ["--pool-tokens", "1024"],
    )
    decode = Role(
        "decode", {**common, "KVGUARD_TRANSFER_BATCH_PAGES": "1"}, ["--pool-tokens", "512"]
    )
    decode.options += ["--prefill-url", prefill.url]
    return prefill, decode


@pytest.fixture(scope="module")
def pairs(tiny_checkpoint: str) -> Iterator[dict[str, Pair]]:
    """Both production pairs, started at once."""
    slot = _slot_bytes(tiny_checkpoint)
    built = {"mooncake": _roles("mooncake", slot), "loopback": _roles("loopback", slot)}
    roles = [role for pair in built.values() for role in pair]
    try:
        for role in roles:
            role.start(tiny_checkpoint)
        for role in roles:
            role.wait_healthy()
        found = {name: Pair(name, p, d, {}) for name, (p, d) in built.items()}
        for pair in found.values():
            wait_for(lambda p=pair: p.capacity()["unavailable"] is None, 60, "the path ready")
        yield found
    finally:
        for role in roles:
            role.stop()


@pytest.fixture(params=["mooncake", "loopback"])
def pair(request: pytest.FixtureRequest, pairs: dict[str, Pair]) -> Pair:
    return pairs[request.param]


def _prompt(tag: str) -> str:
    return (f"{tag}: the quarterly numbers for the account " * 20)[: PROMPT_TOKENS - 1]


def _in_background(pair: Pair, prompt: str, request_id: str) -> tuple[threading.Thread, dict]:
    out: dict[str, httpx.Response] = {}

    def run() -> None:
        out["response"] = pair.ask(prompt, request_id)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_at_rest_nothing_is_registered_and_each_port_listens_where_asked(pair: Pair) -> None:
    target = pair.target()
    port = int(target["endpoint"].rpartition(":")[2])
    if pair.transport == "mooncake":
        for role in (pair.prefill, pair.decode):
            assert segment(pair.mooncake_endpoint(role)) == []  # no pool, no standing buffer
        assert listening_host(port) in ("0.0.0.0", "::")  # Mooncake's choice, asked for
    else:
        assert target["endpoint"].startswith("127.0.0.1:")
        assert listening_host(port) == "127.0.0.1"
        data = kv_like_bytes(target["slot_bytes"])
        slots = range(target["slots"])
        address = target["base"]
        assert not any(
            loopback_write(target["endpoint"], address + k * target["slot_bytes"], data)
            for k in slots
        )


def test_a_peer_reads_only_ciphertext_of_an_in_flight_transfer(pairs: dict[str, Pair]) -> None:
    pair = pairs["mooncake"]  # the loopback protocol has no read
    prompt = _prompt("read")
    honest = pair.honest_answer(prompt)
    endpoint, slot_bytes = pair.target()["endpoint"], pair.target()["slot_bytes"]
    attacker = MooncakePeer()
    thread, out = _in_background(pair, prompt, "read-1")
    buffers: list[Buffer] = wait_for(lambda: segment(endpoint), 30, "a handoff's slots")
    pages = -(-PROMPT_TOKENS // PAGE)
    assert all(b.length % slot_bytes == 0 for b in buffers)
    assert sum(b.length for b in buffers) == pages * slot_bytes  # sized to this handoff alone
    landed: list[bytes] = []
    while thread.is_alive():
        assert segment(pair.mooncake_endpoint(pair.prefill)) == []
        for buffer in buffers:
            raw = attacker.read(endpoint, buffer)
            if raw is not None and any(raw):
                landed.append(raw)
    thread.join()
    assert out["response"].status_code == 200
    assert out["response"].json()["choices"][0]["text"] == honest  # reading changed nothing
    assert landed, "no sealed page was read while the transfer ran"
    assert not any(looks_like_kv(raw) for raw in landed)
    assert segment(endpoint) == []  # withdrawn at the handoff's end


def _hammer(pair: Pair, thread: threading.Thread) -> int:
    """Write KV-looking bytes into every landing slot reachable, until the request ends;
    returns how many writes the transport accepted."""
    target = pair.target()
    size = target["slot_bytes"]
    accepted = 0
    if pair.transport == "mooncake":
        attacker = MooncakePeer(scratch_bytes=size * target["slots"])
        while thread.is_alive():
            for buffer in segment(target["endpoint"]):
                accepted += attacker.write(target["endpoint"], buffer, kv_like_bytes(buffer.length))
        return accepted
    data = kv_like_bytes(size)
    while thread.is_alive():
        for k in range(target["slots"]):
            accepted += loopback_write(target["endpoint"], target["base"] + k * size, data)
    return accepted


def test_writes_into_the_transfer_fail_that_request_closed_or_change_nothing(pair: Pair) -> None:
    prompt = _prompt("write")
    honest = pair.honest_answer(prompt)
    refusals = "kvguard_engine_handoff_refusals_total"
    refused_before = pair.metric(refusals, check="seal")
    refused = 0
    for attempt in range(3):
        request_id = f"attack-{pair.transport}-{attempt}"
        thread, out = _in_background(pair, prompt, request_id)
        accepted = _hammer(pair, thread)
        thread.join()
        assert accepted > 0, "the attacker's writes never reached a registered slot"
        response = out["response"]
        if response.status_code == 200:  # every write it made was overwritten by prefill's
            assert response.json()["choices"][0]["text"] == honest
            continue
        body = response.json()
        assert response.status_code == 502 and body["error"]["code"] == "kv_handoff_refused"
        assert body["kvguard"]["handoff"]["failed_check"] == "seal"
        pair.decode.logged(f"handoff {request_id} refused by the seal check")
        refused += 1
        break
    assert refused == 1, "no attack got as far as the seal in three tries"
    assert pair.metric(refusals, check="seal") == refused_before + 1
    # Nothing was quarantined: the pages are free again and the next request is served.
    pool = pair.capacity()["pool_pages"]
    wait_for(lambda: pair.capacity()["free_pages"] == pool, 10, "pages freed")
    assert pair.capacity()["quarantined_pages"] == 0
    after = pair.ask(prompt, f"after-{pair.transport}")
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == honest


def _handoff(target: dict[str, Any], tiny_checkpoint: str, **changes: Any) -> dict[str, Any]:
    config = json.loads((Path(tiny_checkpoint) / "config.json").read_text())
    layout = {
        "num_layers": config["num_hidden_layers"],
        "num_pages": target["slots"],
        "page_size": PAGE,
        "num_kv_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "dtype": config["dtype"],
    }
    announced = {
        "endpoint": target["endpoint"],
        "instance_id": target["instance"],
        "channel": "sealed",
        "bases": [target["base"]],
        "layout": layout,
        "max_batch_pages": 1,
    }
    sampling = {
        "max_tokens": 2,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
        "stop_token_ids": [],
        "logit_bias": [],
        "logprobs": None,
        "grammar": None,
    }
    return {
        "protocol_version": PROTOCOL_VERSION,
        "request_id": "redirect",
        "tenant": "victim",
        "prompt_ids": list(range(65, 81)),
        "sampling": sampling,
        "reserved_tokens": 16,
        "pages": [{"page_id": 0, "generation": 1}],
        "target": {**announced, **changes},
        "lease_s": 5.0,
        "seal_key": os.urandom(32).hex(),
    }


def test_prefill_writes_only_to_a_target_a_decode_announced(
    pair: Pair, tiny_checkpoint: str
) -> None:
    target = pair.target()
    host = target["endpoint"].rpartition(":")[0]
    attacker = MooncakePeer()
    own = f"127.0.0.1:{attacker.engine.get_rpc_port()}"
    attacker.engine.register_memory(attacker.scratch.data_ptr(), attacker.scratch.numel())
    wrong = {
        "another port of the decode's host": {"endpoint": own},
        "another instance": {"instance_id": "0" * 16},
        "another memory range": {"bases": [attacker.scratch.data_ptr()]},
        "another host": {"endpoint": f"10.9.8.7:{target['endpoint'].rpartition(':')[2]}"},
    }
    assert host == "127.0.0.1"
    for why, changes in wrong.items():
        body = _handoff(target, tiny_checkpoint, **changes)
        r = httpx.post(pair.prefill.url + "/kv/v1/prefill", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 403, (why, r.text)
        assert r.json()["error"]["code"] == "target_not_allowed"
    assert not any(attacker.scratch.tolist())  # nothing was written into the attacker's memory
    # The exact announced target passes the gate (and the write fails: no handoff holds page 0).
    exact = httpx.post(
        pair.prefill.url + "/kv/v1/prefill",
        json=_handoff(target, tiny_checkpoint),
        headers=AUTH,
        timeout=30,
    )
    assert exact.status_code == 200 and exact.json()["outcome"] == "failed", exact.text


def test_the_attackers_test_for_kv_tells_kv_from_the_same_kv_sealed() -> None:
    kv = torch.randn(2, 16, 2, 16).numpy().tobytes()  # K of one page, as the pool holds it
    sealed = bytearray(len(kv) + OVERHEAD)
    Seal(new_seal_key()).close_into(memoryview(kv), b"aad", memoryview(sealed))
    assert looks_like_kv(kv) and looks_like_kv(kv + bytes(len(kv)))  # landed or half landed
    assert not looks_like_kv(bytes(sealed)) and not looks_like_kv(bytes(len(kv)))


def test_development_says_where_mooncake_listens(caplog: pytest.LogCaptureFixture) -> None:
    transport = make_transport(BackendSettings(transport="mooncake"))
    try:
        assert "listens on every interface" in caplog.text
        assert "production refuses this unless KVGUARD_TRANSFER_BIND=0.0.0.0" in caplog.text
    finally:
        transport.close()


@pytest.mark.parametrize(
    ("role", "env", "expected"),
    [
        ("decode", {"KVGUARD_KV_CHANNEL": "open"}, "KVGUARD_KV_CHANNEL=open registers decode's"),
        ("prefill", {"KVGUARD_KV_CHANNEL": "open"}, "KVGUARD_KV_CHANNEL=open registers decode's"),
        ("prefill", {}, "the Mooncake transfer engine listens on every interface"),
        ("decode", {}, "the Mooncake transfer engine listens on every interface"),
    ],
)
def test_production_refuses_an_unsealed_channel_or_an_unasked_bind(
    role: str,
    env: dict[str, str],
    expected: str,
    tiny_checkpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in [n for n in os.environ if n.startswith("KVGUARD_")]:
        monkeypatch.delenv(name)
    production = {
        "KVGUARD_MODE": "production",
        "KVGUARD_ENGINE_TOKEN": TOKEN,
        "KVGUARD_DECODE_PEERS": '["127.0.0.1"]',
        "KVGUARD_TRANSPORT": "mooncake",
        **env,
    }
    for name, value in production.items():
        monkeypatch.setenv(name, value)
    argv = ["backend", role, "--port", "1", "--model", tiny_checkpoint]
    if role == "decode":
        argv += ["--prefill-url", "http://127.0.0.1:1"]
    assert main(argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"kvguard backend {role}: cannot start") and expected in line, line
