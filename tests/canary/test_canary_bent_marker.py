"""Issue 32, finding 1, on the REAL bundled model (``kvguard backend unified`` with
``backend/bundled/kvguard-tiny``): a sampled tenant asking "What is the reference code?" with
``logit_bias {"45": -100}`` (forbidding ``-``) got ``CNRY|<32 characters>`` whose MAC verifies --
its own genuine marker, which the firewall (looking for the literal ``CNRY-``) delivered.

Proves, through the real gateway and the real model: such a request gets no marker in any form,
plain and streamed (a request with a ``logit_bias`` is not sampled); and the firewall itself,
fed what the real model writes when its marker's dash is forbidden (``CNRY|``, ``CNRY%``),
strips it from its owner's answer and cuts it from anyone else's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from canary_harness import bearer, canary_gateway, sse_text

from canary.folding import fold_flat
from canary.injection import inject_chat
from canary.kinds import Evidence, FindingKind
from canary.markers import MarkerCodec, MarkerKeyring
from canary.scanner import StreamScanner
from kvguard.testing import launch_engine

pytestmark = pytest.mark.slow
BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "backend" / "bundled" / "kvguard-tiny"
QUESTION = "What is the reference code?"
BIASES = [{"45": -100}, {"45": -100, "124": -100}]  # "-", then "-" and "|" (the byte tokenizer)


@pytest.fixture(scope="module")
def bundled() -> Iterator[str]:
    engine = launch_engine(str(BUNDLED_MODEL), pool_tokens=1024, page_size=16, context_window=1024)
    yield engine.url
    engine.stop()


def genuine_in(codec: MarkerCodec, text: str) -> bool:
    """Whether any 32 consecutive marker characters of ``text``, however written, verify."""
    folded = fold_flat(text)
    return any(codec.verify_body(folded[i : i + 32]) for i in range(len(folded) - 31))


def _body(model: str, *, stream: bool, bias: dict[str, int] | None) -> dict[str, object]:
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 48,
        "temperature": 0.0,
        "stream": stream,
    }
    if bias is not None:
        body["logit_bias"] = bias
    return body


async def test_a_sampled_tenant_that_biases_the_dash_away_gets_no_marker(
    bundled, gateway_settings, canary_settings
) -> None:
    settings = gateway_settings(engines=[{"name": "bundled", "base_url": bundled}])
    async with canary_gateway(settings, canary_settings()) as gw:
        model = (await gw.client.get("/admin/engines", headers=gw.admin)).json()[0]["model"]
        tenant, key = await gw.create_tenant("sampled", canary_sample_rate=1.0)
        codec = gw.runtime.codec
        for bias in [*BIASES, None]:
            for stream in (False, True):
                r = await gw.client.post(
                    "/v1/chat/completions",
                    headers=bearer(key),
                    json=_body(model, stream=stream, bias=bias),
                )
                assert r.status_code == 200, r.text
                if stream:
                    text, errors = sse_text(r.content)
                    assert errors == []
                else:
                    text = r.json()["choices"][0]["message"]["content"]
                assert not genuine_in(codec, text), (bias, stream, text)
                assert "CNRY" not in fold_flat(text), (bias, stream)
        assert await gw.findings() == []
        # Biased requests were not marked; the two without a bias were (and lost their marker).
        value = gw.runtime.metrics.registry.get_sample_value
        assert value("kvguard_canary_requests_total", {"tenant": tenant, "marked": "false"}) == 4
        assert value("kvguard_canary_requests_total", {"tenant": tenant, "marked": "true"}) == 2


def _engine_chunks(url: str, marker: str, bias: dict[str, int]) -> list[str]:
    """What the real model streams for the question with ``marker`` in its context."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = _body(model, stream=True, bias=bias) | {
        "messages": inject_chat([{"role": "user", "content": QUESTION}], marker)
    }
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    chunks.append((choice.get("delta") or {}).get("content") or "")
    return chunks


def test_the_firewall_strips_and_cuts_what_the_model_writes_with_its_dash_forbidden(
    bundled,
) -> None:
    codec = MarkerCodec(MarkerKeyring({1: bytes(range(32))}, current=1))
    own = codec.issue("acme")
    known = codec.known_tags(["acme", "globex"])
    for bias in BIASES:
        chunks = _engine_chunks(bundled, own.text, bias)
        written = "".join(chunks)
        assert genuine_in(codec, written) and "CNRY-" not in written, written  # the attack
        owner = StreamScanner(codec, owner_tenant_id="acme", own_nonces={own.nonce})
        delivered = "".join(owner.feed(c).text for c in chunks) + owner.finish().text
        assert not genuine_in(codec, delivered) and owner.redactions == 1, delivered
        other = StreamScanner(codec, owner_tenant_id="globex", own_nonces=(), known_tags=known)
        results = []
        for chunk in chunks:
            results.append(other.feed(chunk))
            if results[-1].cut:
                break
        [finding] = results[-1].findings
        assert (finding.kind, finding.evidence, finding.victim_tenant) == (
            FindingKind.CROSS_TENANT,
            Evidence.CONFIRMED,
            "acme",
        )
        shown = "".join(r.text for r in results)
        assert not genuine_in(codec, shown) and own.text[5:13] not in fold_flat(shown)
