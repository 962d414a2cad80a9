"""``POST /v1/embeddings`` through the gateway: passed through to the vLLM and SGLang stand-ins
serving an embedding model (``standin_vllm``/``standin_sglang``: their real routes' shapes) and to
a provider through litellm (``litellm.aembedding``), with the tenant's key, its tokens per minute
charged a bound and settled by the engine's usage, and a content-free audit row; a model no engine
serves embeddings for (the bundled engine, a generative vLLM or SGLang) is a 404 naming the model
and the endpoint; the body is checked against OpenAI's ``CreateEmbeddingRequest``."""

from __future__ import annotations

import os
from typing import Any

import openai
import pytest
from gateway_harness import Gateway, bearer, running_gateway
from openai_contract import check
from sqlalchemy import select
from standin_openai import ProviderControls, provider_app
from standin_sglang import SGLangWorker
from standin_sglang import worker_app as sglang_app
from standin_vllm import VLLMWorker
from standin_vllm import worker_app as vllm_app

from contracts.plugins import Cut, Emit, GatewayHooks, GuardCapabilities, RequestInfo, StreamGuard
from contracts.sql import session_scope
from gateway.db.models import RequestAudit
from kvguard.testing import serve

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")

EMBEDDINGS = "/v1/embeddings"
INPUTS = ["hello world", "the quick brown fox"]  # 2 + 2 and 4 + 2 tokens on the stand-ins


def _worker(kind: str, *, embedding: bool) -> tuple[Any, VLLMWorker | SGLangWorker]:
    if kind == "vllm":
        vllm = VLLMWorker(model="e5-small", embed=embedding)
        return vllm_app(vllm), vllm
    sglang = SGLangWorker(model="bge-small", is_embedding=embedding)
    return sglang_app(sglang), sglang


async def _audit(gw: Gateway) -> list[RequestAudit]:
    await gw.state.audit.flush()
    with session_scope(gw.state.sessions) as session:
        rows = session.scalars(select(RequestAudit).where(RequestAudit.endpoint == "embeddings"))
        return list(rows.all())


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_an_embedding_model_is_served_limited_and_audited(make_settings, kind) -> None:
    app, worker = _worker(kind, embedding=True)
    server = await serve(app)
    try:
        settings = make_settings(engines=[{"name": kind, "kind": kind, "base_url": server.url}])
        async with running_gateway(settings) as gw:
            tenant_id, key = await gw.create_tenant("acme", tokens_per_minute=60)
            body = {"model": worker.model, "input": INPUTS, "dimensions": 4}
            r = await gw.client.post(EMBEDDINGS, json=body, headers=bearer(key))
            assert r.status_code == 200, r.text
            answer = r.json()
            check("CreateEmbeddingRequest", body)
            check("CreateEmbeddingResponse", answer)
            assert [d["index"] for d in answer["data"]] == [0, 1]
            assert all(len(d["embedding"]) == 4 for d in answer["data"])
            assert answer["usage"]["prompt_tokens"] == 4 + 6
            # charged the bound (11 + 4 and 19 + 4 bytes) at admission: what the headers show
            assert (
                r.headers["x-ratelimit-limit-tokens"],
                r.headers["x-ratelimit-remaining-tokens"],
            ) == ("60", "22")
            sent = worker.traffic.bodies[-1]
            assert sent == body  # as the client wrote it
            assert worker.traffic.headers[-1]["x-kvguard-tenant"] == tenant_id

            # The official SDK (base64 by default, decoded by it), token-id input too.
            client = openai.AsyncOpenAI(
                base_url=str(gw.client.base_url).rstrip("/") + "/v1", api_key=key
            )
            created = await client.embeddings.create(model=worker.model, input=[[5, 6, 7]])
            assert len(created.data[0].embedding) == 8 and created.usage.prompt_tokens == 3

            rows = await _audit(gw)
            assert [(a.prompt_tokens, a.completion_tokens, a.http_status) for a in rows] == [
                (10, 0, 200),
                (3, 0, 200),
            ]
            assert {a.engine for a in rows} == {kind} and {a.outcome for a in rows} == {"completed"}

            # Tokens per minute: charged the bound (bytes + 4 per input), settled by usage. A
            # bound over the whole plan is refused outright; the charge is real (a 429 follows).
            huge = {"model": worker.model, "input": "w " * 40}  # bound 84 > 60
            r = await gw.client.post(EMBEDDINGS, json=huge, headers=bearer(key))
            assert (r.status_code, r.json()["error"]["code"]) == (400, "exceeds_tokens_per_minute")
            big = {"model": worker.model, "input": "w " * 20}  # bound 44, uses 22
            first = await gw.client.post(EMBEDDINGS, json=big, headers=bearer(key))
            second = await gw.client.post(EMBEDDINGS, json=big, headers=bearer(key))
            assert (first.status_code, second.status_code) == (200, 429)
            assert second.headers["x-ratelimit-limit-tokens"] == "60"
            assert int(second.headers["x-ratelimit-remaining-tokens"]) < 44
    finally:
        await server.stop()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_a_generative_engine_answers_404_naming_model_and_endpoint(
    make_settings, kind
) -> None:
    app, worker = _worker(kind, embedding=False)
    server = await serve(app)
    try:
        settings = make_settings(engines=[{"name": kind, "kind": kind, "base_url": server.url}])
        async with running_gateway(settings) as gw:
            _, key = await gw.create_tenant("acme", tokens_per_minute=1000)
            body = {"model": worker.model, "input": "hello"}
            r = await gw.client.post(EMBEDDINGS, json=body, headers=bearer(key))
            assert r.status_code == 404, r.text
            check("ErrorResponse", r.json())
            error = r.json()["error"]
            assert (error["code"], error["param"]) == ("model_not_found", "model")
            assert f"'{worker.model}'" in error["message"]
            assert "POST /v1/embeddings" in error["message"]
            assert worker.traffic.paths.count(EMBEDDINGS) == 1  # the engine was asked: no
            assert [a.http_status for a in await _audit(gw)] == [404]
    finally:
        await server.stop()


async def test_the_bundled_engine_serves_no_embeddings_and_the_body_is_checked(
    gateway, standin
) -> None:
    _, key = await gateway.create_tenant("acme")
    model = standin.controls.model
    r = await gateway.client.post(
        EMBEDDINGS, json={"model": model, "input": "hello"}, headers=bearer(key)
    )
    assert r.status_code == 404
    assert r.json()["error"]["message"] == (
        f"model '{model}' serves no embeddings here: no engine serving it answers "
        "POST /v1/embeddings"
    )
    assert standin.controls.seen_bodies == []
    unknown = await gateway.client.post(
        EMBEDDINGS, json={"model": "nope", "input": "hello"}, headers=bearer(key)
    )
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "model_not_found")

    async def refused(body: dict[str, Any]) -> tuple[int, str | None]:
        r = await gateway.client.post(EMBEDDINGS, json=body, headers=bearer(key))
        return r.status_code, r.json()["error"]["param"]

    assert await refused({"model": model}) == (400, "input")
    for bad in ("", [], [""], [1, "a"], [[]], [-1], [True], ["x"] * 2049, {"a": 1}):
        assert await refused({"model": model, "input": bad}) == (400, "input"), bad
    assert await refused({"model": model, "input": "x", "encoding_format": "hex"}) == (
        400,
        "encoding_format",
    )
    assert await refused({"model": model, "input": "x", "dimensions": 0}) == (400, "dimensions")
    assert await refused({"model": model, "input": "x", "normalize": True}) == (400, "normalize")
    anonymous = await gateway.client.post(EMBEDDINGS, json={"model": model, "input": "x"})
    assert anonymous.status_code == 401


async def test_a_provider_through_litellm(make_settings) -> None:
    controls = ProviderControls(model="text-embedding-3-small")
    provider = await serve(provider_app(controls))
    engine = {
        "name": "hosted",
        "kind": "litellm",
        "base_url": f"{provider.url}/v1",
        "model": "text-embedding-3-small",
        "litellm_model": "openai/text-embedding-3-small",
        "declared_max_model_len": 8192,
        "allow_unverified": True,
        "api_key": "sk-provider",
    }
    try:
        async with running_gateway(make_settings(engines=[engine])) as gw:
            _, key = await gw.create_tenant("acme")
            body = {"model": "text-embedding-3-small", "input": INPUTS, "dimensions": 3}
            r = await gw.client.post(EMBEDDINGS, json=body, headers=bearer(key))
            assert r.status_code == 200, r.text
            answer = r.json()
            check("CreateEmbeddingResponse", answer)
            assert [len(d["embedding"]) for d in answer["data"]] == [3, 3]
            assert answer["usage"]["prompt_tokens"] == 10
            assert controls.traffic.bodies[-1]["input"] == INPUTS
            assert [a.prompt_tokens for a in await _audit(gw)] == [10]
    finally:
        await provider.stop()


class CutOn(StreamGuard):
    """A test guard: cuts a text holding ``word`` (the canary's firewall stands behind this API)."""

    def __init__(self, word: str) -> None:
        self.word, self.held = word, ""

    def feed(self, text: str) -> Emit | Cut:
        self.held += text
        if self.word in self.held:
            return Cut(code="isolation_violation", message="response stopped by the canary")
        return Emit("")

    def finish(self) -> Emit | Cut:
        out, self.held = self.held, ""
        return Emit(out)


class Guards:
    capabilities = GuardCapabilities()

    def __init__(self) -> None:
        self.cuts: list[tuple[RequestInfo, Cut]] = []

    def open(self, info: RequestInfo) -> CutOn:
        return CutOn("SECRET")

    async def on_cut(self, info: RequestInfo, cut: Cut) -> None:
        self.cuts.append((info, cut))


async def test_an_engine_refusal_passes_through_screened(make_settings) -> None:
    worker = VLLMWorker(model="e5-small", embed=True)
    server = await serve(vllm_app(worker))
    guards = Guards()
    hooks = GatewayHooks(guards=guards, on_cut=guards.on_cut)
    try:
        engines = [{"name": "vllm", "kind": "vllm", "base_url": server.url}]
        async with running_gateway(make_settings(engines=engines), hooks=hooks) as gw:
            tenant_id, key = await gw.create_tenant("acme")
            body = {"model": worker.model, "input": "hello"}
            worker.refuse = "input is not valid here"
            r = await gw.client.post(EMBEDDINGS, json=body, headers=bearer(key))
            assert (r.status_code, r.json()["error"]["message"]) == (400, worker.refuse)
            # the engine's words pass on without an address in them (gateway.proxy.disclosure)
            worker.refuse = f"input refused by worker {server.url.removeprefix('http://')}"
            r = await gw.client.post(EMBEDDINGS, json=body, headers=bearer(key))
            message = r.json()["error"]["message"]
            assert (r.status_code, message) == (400, "input refused by worker <internal>"), r.text
            worker.refuse = "input echoes SECRET from elsewhere"
            r = await gw.client.post(EMBEDDINGS, json=body, headers=bearer(key))
            assert (r.status_code, r.json()["error"]["code"]) == (502, "isolation_violation")
            assert "SECRET" not in r.text and r.headers["x-should-retry"] == "false"
            assert [(i.tenant_id, i.engine, c.code) for i, c in guards.cuts] == [
                (tenant_id, "vllm", "isolation_violation")
            ]
            assert [a.outcome for a in await _audit(gw)] == ["rejected", "rejected", "cut"]
    finally:
        await server.stop()


async def test_litellm_and_langchain_clients_embed_through_the_gateway(make_settings) -> None:
    import litellm
    from langchain_openai import OpenAIEmbeddings

    worker = VLLMWorker(model="e5-small", embed=True)
    server = await serve(vllm_app(worker))
    try:
        engines = [{"name": "vllm", "kind": "vllm", "base_url": server.url}]
        async with running_gateway(make_settings(engines=engines)) as gw:
            _, key = await gw.create_tenant("acme")
            base = str(gw.client.base_url).rstrip("/") + "/v1"
            answer = await litellm.aembedding(
                model=f"openai/{worker.model}", api_base=base, api_key=key, input=INPUTS
            )
            assert [len(d["embedding"]) for d in answer.data] == [8, 8]
            lc = OpenAIEmbeddings(
                model=worker.model, base_url=base, api_key=key, check_embedding_ctx_length=False
            )
            vectors = await lc.aembed_documents(INPUTS)
            assert [len(v) for v in vectors] == [8, 8]
            assert vectors[0] == pytest.approx(answer.data[0]["embedding"], rel=1e-6)
    finally:
        await server.stop()
