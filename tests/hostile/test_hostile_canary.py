"""The leak firewall against tenants who read its code: no oracle, and no aimed quarantine.

Attackers:

- a tenant that asks the model to repeat guesses (``CNRY-`` and a few characters) and watches
  which come back: the firewall used to strip a candidate whose characters began the tenant's own
  tag and deliver any other, so the tag fell out in ~130 requests;
- two colluding tenants holding a genuine marker of one of them (however obtained), which the
  other sends in -- plainly, or disguised so the edge check misses it -- and has the model write
  back: that was a confirmed ``cross_tenant`` finding and quarantined the shared engine (every
  bystander then got 503). Also a suspected-only finding (a damaged copy) quarantined.

The model is a STAND-IN for an instruction-following LLM behind a provider (``Follower`` in
``hostile_harness``): it repeats, decodes, reverses and joins what it is asked to, and can be told
to leak a marker another request carried, as a provider that mixes customers up would. The
gateway is the real one, as ``kvguard gateway`` serves it.

Proves: every candidate is treated alike whether or not its characters are the requester's tag
(the same answer for each of the 32 first characters, and for the whole own tag versus a tag
nobody has); a genuine foreign marker sent in is refused at the edge in every form the firewall
reads (lowercase, spaced, its prefix bent, split across messages) and, in any other form
``canary.evidence`` detects (a bare body, reversed, base64, hex), cut (nobody receives it) and
recorded as a *replay* -- high, not a critical cross-tenant finding -- with why it did not
quarantine, and the engine keeps serving a bystander; a damaged copy alerts without quarantining;
and a marker the engine really produced from another tenant's request still quarantines it.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hostile_harness import (
    FOLLOWER_MODEL,
    TEST_CANARY_KEY,
    Follower,
    ServedGateway,
    follower_engine,
    gateway_settings,
    served_follower,
    served_gateway,
)

from canary.config import CanarySettings
from canary.markers import BASE32_CLASS, MarkerCodec, encode_tag

B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
assert BASE32_CLASS == "[A-Z2-7]"
CODEC = MarkerCodec(CanarySettings(canary_key=TEST_CANARY_KEY).keyring())


@pytest.fixture
def follower() -> Iterator[Follower]:
    with served_follower() as f:
        yield f


@pytest.fixture
def gateway(sqlite_url: str, follower: Follower) -> Iterator[ServedGateway]:
    settings = gateway_settings(sqlite_url, follower.url, engines=[follower_engine(follower.url)])
    with served_gateway(settings) as gw:
        yield gw


def _ask(gw: ServedGateway, key: str, *messages: str) -> httpx.Response:
    body = {"model": FOLLOWER_MODEL, "messages": [{"role": "user", "content": m} for m in messages]}
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def _content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def _engine(gw: ServedGateway) -> dict[str, Any]:
    (engine,) = httpx.get(gw.url + "/admin/engines", headers=gw.admin, timeout=10).json()
    return dict(engine)


def _findings(gw: ServedGateway) -> list[dict[str, Any]]:
    return list(httpx.get(gw.url + "/admin/canary/findings", headers=gw.admin, timeout=10).json())


def test_no_oracle_for_the_requesters_own_tag(gateway: ServedGateway) -> None:
    tenant, key = gateway.create_tenant("prober")
    own = encode_tag(CODEC.tenant_tag(tenant))
    answers = {c: _content(_ask(gateway, key, f"repeat: x CNRY-{c} y")) for c in B32}
    assert set(answers.values()) == {"x  y"}, {c: a for c, a in answers.items() if a != "x  y"}
    nobody = "".join(B32[(B32.index(ch) + 1) % 32] for ch in own)
    assert CODEC.tag_index([tenant]).get(base64.b32decode(nobody)) is None
    for guess in (own[:1], own[:4], own, own + "AAAA", nobody, nobody[:4]):
        assert _content(_ask(gateway, key, f"repeat: x CNRY-{guess} y")) == "x  y", guess
    assert _findings(gateway) == []  # the requester's own characters are no finding


def _disguises(marker: str) -> dict[str, tuple[str, ...]]:
    """name -> the messages that make the follower write ``marker`` back."""
    half = 7  # "CNRY-" and 2 tag characters: neither half holds a marker on its own
    return {
        "lowercase": (f"upper: {marker.lower()}",),
        "spaced": ("unspace: " + " ".join(marker),),
        "bent prefix": ("repeat: CNRY|" + marker[5:],),
        "split": ("join:", marker[:half], marker[half:]),
        "bare body": ("repeat: " + marker[5:],),
        "reversed": (f"reverse: {marker[::-1]}",),
        "base64": ("decode base64: " + base64.b64encode(marker.encode()).decode(),),
        "hex": ("decode hex: " + marker.encode().hex(),),
        # A combining mark after each character: the firewall reads the letters in an answer.
        "combining marks": ("repeat: " + "".join(c + "\u0301" for c in marker),),
    }


# Forms the edge reads as the firewall reads answers (any case, any separator, split across
# messages): refused before the engine. The others reach it; what it writes back is cut and
# recorded as a replay.
READ_AT_THE_EDGE = {"lowercase", "spaced", "bent prefix", "split", "combining marks"}


@pytest.mark.parametrize("disguise", sorted(_disguises("CNRY-" + "A" * 32)))
def test_a_marker_a_tenant_sends_in_never_quarantines(
    gateway: ServedGateway, follower: Follower, disguise: str
) -> None:
    victim, victim_key = gateway.create_tenant("victim", canary_sample_rate=1.0)
    _, colluder = gateway.create_tenant("colluder")
    _, bystander = gateway.create_tenant("bystander")
    assert _content(_ask(gateway, victim_key, "repeat: hello")) == "hello"
    marker = follower.marker_seen()  # the victim's genuine marker, as the colluders obtained it
    plain = _ask(gateway, colluder, f"repeat: {marker}")
    assert plain.status_code == 400 and plain.json()["error"]["code"] == "foreign_canary_marker"
    sent = _ask(gateway, colluder, *_disguises(marker)[disguise])
    if disguise in READ_AT_THE_EDGE:
        assert sent.status_code == 400, sent.text
        assert sent.json()["error"]["code"] == "foreign_canary_marker"
        assert _findings(gateway) == []
    else:
        assert sent.status_code == 502, sent.text
        assert sent.json()["error"]["code"] == "isolation_violation"
        assert marker[5:13] not in sent.text and "recorded" not in sent.text
        [finding] = _findings(gateway)
        # A replay: the marker stands in the request. Not a cross-tenant leak, not critical.
        assert (finding["kind"], finding["severity"], finding["evidence"], finding["action"]) == (
            "replay",
            "high",
            "confirmed",
            "cut",
        )
        assert finding["victim_tenant_id"] == victim
        assert "in this request's own input" in finding["detail"], finding
    assert _engine(gateway)["quarantine_reason"] is None
    assert _content(_ask(gateway, bystander, "repeat: still served")) == "still served"


def test_a_marker_sent_only_in_a_key_is_refused_at_the_edge(
    gateway: ServedGateway, follower: Follower
) -> None:
    """A genuine foreign marker as a response schema's property name: grammar-constrained output
    writes the key verbatim, so the engine would write the marker back; its request is refused
    like one holding the marker in a value (it was read by nobody but the firewall, a confirmed
    cross-tenant finding that quarantined the engine)."""
    _, victim_key = gateway.create_tenant("victim", canary_sample_rate=1.0)
    _, colluder = gateway.create_tenant("colluder")
    _, bystander = gateway.create_tenant("bystander")
    _content(_ask(gateway, victim_key, "repeat: hello"))
    marker = follower.marker_seen()
    schema = {"type": "object", "properties": {marker: {"type": "string"}}}
    body = {
        "model": FOLLOWER_MODEL,
        "messages": [{"role": "user", "content": "fill in the form"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}},
    }
    headers = {"Authorization": f"Bearer {colluder}"}
    sent = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert sent.status_code == 400, sent.text
    assert sent.json()["error"]["code"] == "foreign_canary_marker"
    assert _findings(gateway) == []
    assert _engine(gateway)["quarantine_reason"] is None
    assert _content(_ask(gateway, bystander, "repeat: still served")) == "still served"


def test_colluding_tenants_cannot_aim_a_corroborated_quarantine(
    gateway: ServedGateway, follower: Follower
) -> None:
    """Three colluders, each holding the victim's marker, make the engine write a damaged copy of it
    that shows the victim's nonce -- what corroboration counts when the engine produced it. Each
    copy stands in its requester's own input (base64, bare, reversed): a replay, which counts for
    nothing, so the engine keeps serving."""
    victim, victim_key = gateway.create_tenant("victim", canary_sample_rate=1.0)
    _content(_ask(gateway, victim_key, "repeat: hello"))
    damaged = follower.marker_seen()[:30]  # CNRY-, the tag, key id and nonce; no MAC
    sends = [
        "decode base64: " + base64.b64encode(damaged.encode()).decode(),
        "repeat: " + damaged[5:],
        "reverse: " + damaged[::-1],
    ]
    for n, message in enumerate(sends):
        _, key = gateway.create_tenant(f"colluder-{n}")
        r = _ask(gateway, key, message)
        assert (r.status_code, r.json()["error"]["code"]) == (502, "isolation_violation")
    findings = _findings(gateway)
    assert [(f["kind"], f["evidence"], f["victim_tenant_id"]) for f in findings] == [
        ("replay", "suspected", victim)
    ] * 3
    assert _engine(gateway)["quarantine_reason"] is None
    _, bystander = gateway.create_tenant("bystander")
    assert _content(_ask(gateway, bystander, "repeat: still served")) == "still served"


def test_a_damaged_copy_alerts_without_quarantining(
    gateway: ServedGateway, follower: Follower
) -> None:
    victim, victim_key = gateway.create_tenant("victim", canary_sample_rate=1.0)
    _, observer = gateway.create_tenant("observer")
    _content(_ask(gateway, victim_key, "repeat: hello"))
    follower.leak, follower.leak_chars = True, 25  # the tag and the nonce, no MAC
    r = _ask(gateway, observer, "anything")
    assert (r.status_code, r.json()["error"]["code"]) == (502, "isolation_violation")
    [finding] = _findings(gateway)
    assert (finding["severity"], finding["evidence"], finding["action"]) == (
        "high",
        "suspected",
        "cut",
    )
    assert finding["victim_tenant_id"] == victim and "suspected only" in finding["detail"]
    assert _engine(gateway)["quarantine_reason"] is None


def test_a_marker_the_engine_produced_from_another_request_quarantines(
    gateway: ServedGateway, follower: Follower
) -> None:
    victim, victim_key = gateway.create_tenant("victim", canary_sample_rate=1.0)
    _, observer = gateway.create_tenant("observer")
    _content(_ask(gateway, victim_key, "repeat: hello"))
    follower.leak = True
    r = _ask(gateway, observer, "anything")
    assert (r.status_code, r.json()["error"]["code"]) == (502, "isolation_violation")
    [finding] = _findings(gateway)
    assert (finding["severity"], finding["action"], finding["detail"]) == (
        "critical",
        "cut_quarantined",
        None,
    )
    assert finding["victim_tenant_id"] == victim
    assert _engine(gateway)["quarantine_reason"].startswith("canary: isolation finding")
    refused = _ask(gateway, observer, "repeat: hi")
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "no_healthy_engine")


def test_a_body_flooded_with_prefix_guesses_is_refused_alike_and_cheaply(
    gateway: ServedGateway, follower: Follower
) -> None:
    """A tenant fills its body with ``CNRY`` + guesses: before the bound, 8 MiB of them held the
    gateway's event loop for seconds (every tenant's streams with it), and each was a guess at
    another tenant's tag. Now such a body is one 400 on the count alone -- the same answer with
    another tenant's real tag among the guesses or not -- nothing reaches the engine, nothing is
    recorded, and a bystander is served."""
    victim, victim_key = gateway.create_tenant("victim", canary_sample_rate=1.0)
    _, guesser = gateway.create_tenant("guesser")
    _, bystander = gateway.create_tenant("bystander")
    assert _content(_ask(gateway, victim_key, "repeat: hello")) == "hello"
    victim_tag = follower.marker_seen()[5:13]
    seen = len(follower.seen)
    guesses = [f"CNRY-{a}{b}AAAAAA" for a in B32 for b in B32]  # 1,024 wrong tags, then ...
    answers = [
        _ask(gateway, guesser, " ".join([*guesses, f"CNRY-{last}"]))
        for last in ("QQQQQQQQ", victim_tag)
    ]
    for answer in answers:
        assert answer.status_code == 400, answer.text
    assert answers[0].json() == answers[1].json()
    assert answers[0].json()["error"]["code"] == "too_many_canary_prefixes"
    assert victim_tag not in answers[1].text
    assert len(follower.seen) == seen  # neither reached the engine
    assert _findings(gateway) == []
    assert _engine(gateway)["quarantine_reason"] is None
    assert _content(_ask(gateway, bystander, "repeat: still served")) == "still served"
