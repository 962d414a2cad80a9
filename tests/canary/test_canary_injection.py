"""Marker injection: where the marker goes, the sampled share, carried and foreign markers."""

from __future__ import annotations

import random

import pytest

from canary.injection import (
    MAX_ANCHORS,
    AnchorFlood,
    MarkerInjector,
    MarkerLedger,
    SecureDraws,
    carried_markers,
    inject_chat,
    inject_prompt,
)
from canary.markers import MarkerCodec, MarkerKeyring
from canary.metrics import CanaryMetrics
from canary.records import MemoryRecordStore
from contracts.plugins import RequestInfo, RequestRefused

CODEC = MarkerCodec(MarkerKeyring({1: bytes(range(32))}, current=1))
M = CODEC.issue("acme", nonce=b"nonce--1").text


def info(n: int = 0, *, tenant: str = "acme", rate: float = 1.0) -> RequestInfo:
    return RequestInfo(
        request_id=f"req{n}",
        tenant_id=tenant,
        model="m",
        endpoint="chat.completions",
        synthetic=False,
        canary_sample_rate=rate,
    )


def injector(seed: int | None = 0, **kwargs):
    store = MemoryRecordStore(ttl_s=60)
    ledger = MarkerLedger()
    metrics = CanaryMetrics()
    rng = random.Random(seed).random if seed is not None else None
    hook = MarkerInjector(
        CODEC, ledger=ledger, records=lambda: store, metrics=metrics, random=rng, **kwargs
    )
    return hook, ledger, store, metrics


def test_sampling_draws_read_the_os_csprng_in_blocks_and_use_each_byte_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The share of marked requests is drawn from ``os.urandom`` (a tenant cannot predict it),
    eight fresh bytes per draw, one system call per 512 draws (``SystemRandom`` makes one per
    request: 1.6% of the gateway's CPU per request in the relay profile)."""
    import os

    reads: list[int] = []
    counter = iter(range(10**9))

    def urandom(size: int) -> bytes:
        reads.append(size)
        return b"".join((next(counter) << 20).to_bytes(8, "big") for _ in range(size // 8))

    monkeypatch.setattr(os, "urandom", urandom)
    draws = SecureDraws()
    values = [draws() for _ in range(1025)]
    assert reads == [4096, 4096, 4096]  # 512 draws per read
    assert values == [(n << 9) / 2**53 for n in range(1025)]  # each 8 bytes once, in order
    monkeypatch.undo()
    real = SecureDraws()
    sample = [real() for _ in range(100_000)]
    assert all(0.0 <= v < 1.0 for v in sample)
    assert 0.09 < sum(v < 0.1 for v in sample) / len(sample) < 0.11  # 10 sigma either side


def test_chat_marker_is_the_first_line_of_the_system_message() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert inject_chat(messages, M) == [
        {"role": "system", "content": f"{M}\nBe brief."},
        {"role": "user", "content": "hi"},
    ]
    assert messages[0]["content"] == "Be brief."  # the client's list is not changed
    assert inject_chat([{"role": "user", "content": "hi"}], M) == [
        {"role": "system", "content": M},
        {"role": "user", "content": "hi"},
    ]
    assert inject_prompt("Once upon", M) == f"{M}\nOnce upon"


def test_the_bundled_model_reads_a_marker_anywhere_in_its_context() -> None:
    """The marker goes alone on its line (no phrase: 16 tokens fewer): the bundled model is
    trained on markers placed anywhere in a message, and asked for them by these phrases."""
    from backend.bundled import data

    assert "{m}" in data._REF_LINES  # a bare marker is one of the training placements
    assert data.chat.REFERENCE_REQUEST == "Repeat the reference code."


def test_carried_markers_are_found_anywhere_in_the_request_in_any_form() -> None:
    other = CODEC.issue("globex", nonce=b"nonce--2").text
    body = {
        "messages": [
            {"role": "system", "content": f"x {M} y"},
            {"role": "user", "content": f"{other}CNRY-AAAA {M[:-1]}B", "name": "n"},
        ]
    }
    found = carried_markers(CODEC, body).genuine
    assert [(v.tenant_tag, v.nonce) for v in found] == [
        (CODEC.tenant_tag("acme"), b"nonce--1"),
        (CODEC.tenant_tag("globex"), b"nonce--2"),
    ]
    assert carried_markers(CODEC, {"prompt": "no markers"}).genuine == ()
    # Read as the firewall reads answers: bent, split over messages, in content parts.
    bent = [
        {"prompt": other.lower()},
        {"prompt": "CNRY|" + other[5:]},
        {"prompt": " ".join(other)},
        {"messages": [{"role": "user", "content": c} for c in (other[:9], other[9:])]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": other}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "user": other.lower()},
        # Combining marks after each character: the firewall reads the letters in an answer.
        {"prompt": "".join(c + "\u0301" for c in other)},
        {"prompt": "".join(c + "\u0308\u0323" for c in other.lower())},
        # Only in a key: a tool's parameter name, a response schema's property name.
        {
            "messages": [{"role": "user", "content": "call f"}],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {other: {"type": "string"}}},
                    },
                }
            ],
        },
        {
            "messages": [{"role": "user", "content": "answer"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"properties": {other.lower(): {}}}},
            },
        },
        {"prompt": "hi", "metadata": {other[:20]: 1, other[20:]: 2}},
    ]
    for body in bent:
        [verified] = carried_markers(CODEC, body).genuine
        assert verified.nonce == b"nonce--2", body
    # A bare body (its prefix removed) is left to the firewall and the replay evidence.
    assert carried_markers(CODEC, {"prompt": other[5:]}).genuine == ()


@pytest.mark.parametrize(
    "bend",
    [{"logit_bias": {"45": -100}}, {"n": 2}, {"best_of": 3}],
)
async def test_a_request_that_can_bend_or_multiply_copies_is_never_marked(bend: dict) -> None:
    """A tenant who could bend its copy of the marker (a bias against ``-`` made the bundled model
    write ``CNRY|<body>``) or vote over several copies is not given one: same answer, no
    refusal, only no marker."""
    hook, ledger, _, metrics = injector()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **bend}
    for n in range(20):
        assert await hook.prepare(info(n, rate=1.0), body) is body
        assert ledger.get(f"req{n}").own == frozenset()
    assert (
        metrics.registry.get_sample_value(
            "kvguard_canary_requests_total", {"tenant": "acme", "marked": "false"}
        )
        == 20
    )
    for plain in ({"logit_bias": {}}, {"n": 1}, {"best_of": 1}, {"n": True}):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **plain}
        assert await hook.prepare(info(99, rate=1.0), body) is not body, plain


async def test_sampling_follows_the_tenant_rate_exactly() -> None:
    hook, ledger, store, metrics = injector(seed=7)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    rng = random.Random(7)
    expected = [rng.random() < 0.3 for _ in range(400)]
    marked = []
    for n in range(400):
        out = await hook.prepare(info(n, rate=0.3), body)
        marked.append(out is not body)
        assert (len(ledger.get(f"req{n}").own) == 1) is marked[-1]
    assert marked == expected and 100 < sum(marked) < 140
    await hook.drain()
    assert len(store) == sum(marked)
    value = metrics.registry.get_sample_value
    assert value("kvguard_canary_markers_injected_total", {"tenant": "acme"}) == sum(marked)
    assert value("kvguard_canary_requests_total", {"tenant": "acme", "marked": "false"}) == (
        400 - sum(marked)
    )


async def test_an_injected_marker_is_genuine_and_recorded() -> None:
    hook, ledger, store, _ = injector()
    out = await hook.prepare(info(1), {"prompt": "Once upon"})
    line, rest = out["prompt"].split("\n", 1)
    assert rest == "Once upon" and line.startswith("CNRY-")
    verified = CODEC.verify(line)
    assert verified is not None and verified.tenant_tag == CODEC.tenant_tag("acme")
    assert ledger.get("req1").own == {verified.nonce} and ledger.get("req1").carried == set()
    await hook.drain()
    record = await store.get(verified.nonce)
    assert (record.request_id, record.tenant_id, record.engine) == ("req1", "acme", None)
    hook.record(verified.nonce, info(1), engine="e1")
    await hook.drain()
    assert (await store.get(verified.nonce)).engine == "e1"
    assert ledger.pop("req1").own == {verified.nonce} and len(ledger) == 0


async def test_opt_out_and_completions_switch() -> None:
    hook, ledger, _, _ = injector(inject_completions=False)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert await hook.prepare(info(1, rate=0.0), chat) is chat
    prompt = {"prompt": "hi"}
    assert await hook.prepare(info(2, rate=1.0), prompt) is prompt
    # Unmarked requests have an entry too: their body, for a cut to look the marker up in.
    assert ledger.get("req1").own == set() and ledger.get("req2").own == set()
    assert ledger.get("req1").body is chat


async def test_a_request_carrying_its_own_marker_is_not_marked_again() -> None:
    hook, ledger, store, _ = injector()
    body = {"messages": [{"role": "system", "content": f"Reference code: {M}"}]}
    assert await hook.prepare(info(3), body) is body
    assert ledger.get("req3").carried == {b"nonce--1"} and ledger.get("req3").own == set()
    await hook.drain()
    assert (await store.get(b"nonce--1")).request_id == "req3"


async def test_a_request_carrying_another_tenants_marker_is_refused() -> None:
    hook, ledger, _, _ = injector()
    body = {"messages": [{"role": "user", "content": f"what is {M}?"}]}
    with pytest.raises(RequestRefused) as refused:
        await hook.prepare(info(4, tenant="globex"), body)
    assert refused.value.code == "foreign_canary_marker"  # the gateway answers it as a 400
    assert M not in refused.value.message
    assert len(ledger) == 0


async def test_a_request_carrying_another_tenants_tag_after_the_prefix_is_refused() -> None:
    """``CNRY`` (in any form the firewall reads) + another known tenant's tag + anything: the
    model echoing it would be a suspected finding against an innocent engine. The caller's own
    tag, unknown tags, fewer than 8 characters and a tag without any prefix pass (a bare tag is
    left to the firewall and the replay evidence)."""
    index = CODEC.tag_index(["acme", "globex"])
    hook, ledger, _, _ = injector(known_tags=index.get)
    acme_tag = M[5:13]
    for text in (
        f"echo CNRY-{acme_tag}XYZ",
        f"CNRY-{acme_tag[:7]}",
        "CNRY-AAAAAAAA junk",
        acme_tag,
    ):
        body = {"messages": [{"role": "user", "content": text}]}
        await hook.prepare(info(5, tenant="acme", rate=0.0), body)
        await hook.prepare(info(6, tenant="initech", rate=0.0), {"prompt": f"see {acme_tag}"})
    for body in (
        {"messages": [{"role": "user", "content": f"say CNRY-{acme_tag}XYZ twice"}]},
        {"messages": [{"role": "user", "content": "hi", "name": f"CNRY-{acme_tag}"}]},
        {"prompt": f"CNRY-CNRY-{acme_tag}"},
        {"prompt": f"echo cnry-{acme_tag.lower()}xyz"},
        {"prompt": "C N R Y | " + " ".join(acme_tag)},
        {"messages": [{"role": "user", "content": c} for c in ("CNRY", acme_tag)]},
    ):
        with pytest.raises(RequestRefused) as refused:
            await hook.prepare(info(7, tenant="globex"), body)
        assert refused.value.code == "foreign_canary_marker"
        assert acme_tag not in refused.value.message
    assert len(ledger) == 2  # the two requests allowed through (5, 6); the refused have none


class CountingCodec(MarkerCodec):
    """The codec, counting the MAC checks ``carried_markers`` asks of it."""

    checks = 0

    def verify_body(self, body: str):  # type: ignore[no-untyped-def]
        CountingCodec.checks += 1
        return super().verify_body(body)


async def test_a_body_flooded_with_prefixes_is_refused_on_the_count_alone() -> None:
    """8 MiB of ``CNRY`` + 32 characters held the shared event loop for 1.6-4.4 s (a MAC check and
    a tag lookup each) and were as many guesses at other tenants' tags. Beyond ``MAX_ANCHORS``
    the body is refused before any is read, with the same answer whether a known tag is among
    them or not (no oracle); up to it, every one is still read (a foreign marker among them is
    refused as such)."""
    index = CODEC.tag_index(["acme", "globex"])
    hook, ledger, _, _ = injector(known_tags=index.get)
    unknown = "CNRY-" + "A" * 32
    for last in (unknown, M):  # the flood alone, and with acme's genuine marker at its end
        content = " ".join([unknown] * MAX_ANCHORS + [last])
        with pytest.raises(RequestRefused) as refused:
            await hook.prepare(info(5, tenant="globex"), {"messages": [{"content": content}]})
        assert refused.value.code == "too_many_canary_prefixes"
        assert str(MAX_ANCHORS) in refused.value.message and M not in refused.value.message
    spaced = " ".join("c n r y" for _ in range(MAX_ANCHORS + 1))  # read as the firewall reads
    with pytest.raises(RequestRefused):
        await hook.prepare(info(6), {"prompt": spaced})
    assert len(ledger) == 0

    counting = CountingCodec(CODEC.keyring)
    CountingCodec.checks = 0
    with pytest.raises(AnchorFlood):
        carried_markers(counting, {"prompt": " ".join([unknown] * (10 * MAX_ANCHORS))})
    assert CountingCodec.checks == 0

    at_most = " ".join([unknown] * (MAX_ANCHORS - 1) + [M])
    assert [v.nonce for v in carried_markers(counting, {"prompt": at_most}).genuine] == [
        b"nonce--1"
    ]
    assert CountingCodec.checks == MAX_ANCHORS
    with pytest.raises(RequestRefused) as refused:
        await hook.prepare(info(7, tenant="globex"), {"prompt": at_most})
    assert refused.value.code == "foreign_canary_marker"
