"""Engine adapters: SGLang and vLLM against payloads in the shape those servers publish
(tests/gateway/fixtures/third_party_*), served over real HTTP; the bundled adapter and token
counting against the stand-in engine; declared (OpenAI/litellm) engines."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from gateway_standin import serve, standin_count, static_app

from gateway.config import EngineSpec
from gateway.engines.adapters import AdapterError, adapter_for
from gateway.engines.adapters.openai_generic import upper_bound_tokens
from gateway.engines.adapters.sglang import snapshot_from_sglang
from gateway.engines.adapters.vllm import snapshot_from_vllm
from gateway.engines.capacity import RoleView

FIXTURES = Path(__file__).parent / "fixtures"
JSON, TEXT = "application/json", "text/plain; version=0.0.4"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_sglang_payload_to_snapshot() -> None:
    info = json.loads(fixture("third_party_sglang_get_server_info.json"))
    models = json.loads(fixture("third_party_sglang_v1_models.json"))
    snapshot = snapshot_from_sglang(info, models)
    assert snapshot.model == "qwen/qwen2.5-0.5b-instruct"
    assert snapshot.context_window == 32768
    assert snapshot.roles == (RoleView(role="unified", pool_tokens=20480, page_size=1),)
    assert (snapshot.max_prompt_tokens, snapshot.enforceable_limit) == (20474, 20480)
    assert snapshot.drift == (
        "advertised window 32768 exceeds the unified role's real KV pool of 20480 tokens"
    )
    info["disaggregation_mode"] = "prefill"
    info["internal_states"].append({"max_total_num_tokens": 12000, "max_req_input_len": 11990})
    split = snapshot_from_sglang(info, models)
    assert (split.roles[0].role, split.real_pool, split.max_prompt_tokens) == (
        "prefill",
        12000,
        11990,
    )
    del info["max_total_num_tokens"]
    with pytest.raises(AdapterError, match="max_total_num_tokens"):
        snapshot_from_sglang(info, models)


def test_vllm_payload_to_snapshot() -> None:
    models = json.loads(fixture("third_party_vllm_v1_models.json"))
    snapshot = snapshot_from_vllm(models, fixture("third_party_vllm_metrics.txt"), wanted=None)
    assert (snapshot.model, snapshot.context_window) == ("qwen3-32b", 8192)
    assert snapshot.roles == (RoleView(role="unified", pool_tokens=573 * 16, page_size=16),)
    assert (snapshot.enforceable_limit, snapshot.drift) == (8192, None)
    unprofiled = snapshot_from_vllm(
        models, fixture("third_party_vllm_metrics_unprofiled.txt"), wanted=None
    )
    assert unprofiled.real_pool is None and not unprofiled.pool_known
    nothing = snapshot_from_vllm(models, "# no metrics\n", wanted=None)
    assert not nothing.pool_known
    with pytest.raises(AdapterError, match="does not list the configured model 'other'"):
        snapshot_from_vllm(models, fixture("third_party_vllm_metrics.txt"), wanted="other")


async def test_sglang_and_vllm_adapters_over_http() -> None:
    sglang = await serve(
        static_app(
            {
                "/server_info": (200, JSON, fixture("third_party_sglang_get_server_info.json")),
                "/v1/models": (200, JSON, fixture("third_party_sglang_v1_models.json")),
            }
        )
    )  # a newer release: /get_server_info is gone, /server_info answers
    vllm = await serve(
        static_app(
            {
                "/v1/models": (200, JSON, fixture("third_party_vllm_v1_models.json")),
                "/metrics": (200, TEXT, fixture("third_party_vllm_metrics.txt")),
            }
        )
    )
    broken = await serve(static_app({"/v1/models": (200, JSON, "[1, 2]")}))
    try:
        async with httpx.AsyncClient() as client:
            spec = EngineSpec(name="s", kind="sglang", base_url=sglang.url)
            snapshot = await adapter_for(spec).introspect(client, timeout=2)
            assert (snapshot.real_pool, snapshot.context_window) == (20480, 32768)
            spec = EngineSpec(name="v", kind="vllm", base_url=vllm.url, model="qwen3-32b")
            snapshot = await adapter_for(spec).introspect(client, timeout=2)
            assert (snapshot.real_pool, snapshot.model) == (9168, "qwen3-32b")
            for kind, error in (("vllm", "not a JSON object"), ("sglang", "HTTP 404")):
                with pytest.raises(AdapterError, match=error):
                    spec = EngineSpec(name="b", kind=kind, base_url=broken.url)
                    await adapter_for(spec).introspect(client, timeout=2)
    finally:
        for server in (sglang, vllm, broken):
            await server.stop()


async def test_bundled_adapter_and_exact_counts(standin) -> None:
    standin.controls.context_window, standin.controls.pool_tokens = 8192, 2048
    standin.controls.faults = ["legacy_handoff"]
    async with httpx.AsyncClient() as client:
        adapter = adapter_for(EngineSpec(name="b", base_url=standin.url))
        snapshot = await adapter.introspect(client, timeout=2)
        assert (snapshot.context_window, snapshot.real_pool, snapshot.enforceable_limit) == (
            8192,
            2048,
            2048,
        )
        assert snapshot.faults == ("legacy_handoff",) and snapshot.drift is not None
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c"}]
        count = await adapter.count_tokens(client, model="m", messages=messages, timeout=2)
        assert count == standin_count(messages=messages) == 11
        assert await adapter.count_tokens(client, model="m", prompt="x y", timeout=2) == 2

        wrong = adapter_for(EngineSpec(name="b", base_url=standin.url, model="other"))
        with pytest.raises(AdapterError, match="serves model 'standin-model'"):
            await wrong.introspect(client, timeout=2)
        standin.controls.capacity_status = 500
        with pytest.raises(AdapterError, match="HTTP 500"):
            await adapter.introspect(client, timeout=2)


async def test_bundled_adapter_refuses_other_schema_versions() -> None:
    report = {"schema_version": 99, "model": "m"}
    server = await serve(static_app({"/engine/capacity": (200, JSON, json.dumps(report))}))
    invalid = await serve(static_app({"/engine/capacity": (200, JSON, '{"schema_version": 1}')}))
    try:
        async with httpx.AsyncClient() as client:
            with pytest.raises(AdapterError, match="schema_version 99 is not 1"):
                await adapter_for(EngineSpec(name="b", base_url=server.url)).introspect(
                    client, timeout=2
                )
            with pytest.raises(AdapterError, match="capacity report invalid"):
                await adapter_for(EngineSpec(name="b", base_url=invalid.url)).introspect(
                    client, timeout=2
                )
    finally:
        await server.stop()
        await invalid.stop()


async def test_declared_engines(standin) -> None:
    spec = EngineSpec(
        name="o", kind="openai", base_url=standin.url, model="hosted", declared_max_model_len=1000
    )
    async with httpx.AsyncClient() as client:
        snapshot = await adapter_for(spec).introspect(client, timeout=2)
        assert (snapshot.measured, snapshot.enforceable_limit, snapshot.model) == (
            False,
            1000,
            "hosted",
        )
        count = await adapter_for(spec).count_tokens(
            client, model="hosted", prompt="héllo", timeout=2
        )
    assert count == upper_bound_tokens("héllo", None) == 6 + 16
    assert upper_bound_tokens(None, [{"role": "user", "content": "ab"}]) == 16 + 16 + 4 + 2
