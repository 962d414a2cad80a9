"""Engine adapters: SGLang and vLLM against stand-ins that follow those servers' sources
(standin_sglang, standin_vllm), served over real HTTP; the bundled adapter and token counting
against the stand-in engine; declared (OpenAI/litellm) engines."""

from __future__ import annotations

import json

import httpx
import pytest
from gateway_standin import standin_count, static_app
from standin_sglang import SGLangWorker
from standin_sglang import worker_app as sglang_app
from standin_vllm import VLLMWorker
from standin_vllm import worker_app as vllm_app

from gateway.engines.adapters import AdapterError, adapter_for
from gateway.engines.adapters.sglang import snapshot_from_sglang
from gateway.engines.adapters.vllm import NO_STATS, pool_from_metrics, snapshot_from_vllm
from gateway.engines.capacity import RoleView
from gateway.engines.provider_count import (
    BYTES_PER_MESSAGE,
    BYTES_PER_REQUEST,
    BYTES_PER_TOOLS,
    upper_bound_tokens,
)
from gateway.engines.spec import EngineSpec
from kvguard.testing import serve

JSON = "application/json"


def test_sglang_server_info_to_snapshot() -> None:
    worker = SGLangWorker(rank_pools=[20480, 18000], context_len=32768)
    models = {"object": "list", "data": [{"id": worker.model, "max_model_len": 32768}]}
    snapshot = snapshot_from_sglang(worker.server_info(), models)
    assert snapshot.model == "qwen/qwen2.5-0.5b-instruct"
    assert snapshot.context_window == 32768
    # rank 1's memory_usage.token_capacity is the smallest pool (the handshake shows rank 0's)
    assert snapshot.roles == (RoleView(role="unified", pool_tokens=18000, page_size=1),)
    assert (snapshot.max_prompt_tokens, snapshot.max_request_tokens) == (20474, 18000)
    assert snapshot.drift == (
        "context window 32768 exceeds the unified role's real KV pool of 18000 tokens; "
        "requests are limited to 18000 tokens"
    )
    assert snapshot.isolation is not None and snapshot.isolation.field == "cache_salt"
    worker.mode, worker.version = "prefill", "0.5.10"
    split = snapshot_from_sglang(worker.server_info(), models)
    assert split.roles[0].role == "prefill"
    assert split.isolation is not None and split.isolation.field is None
    assert "honoured from 0.5.12" in split.isolation.detail
    worker.version, worker.hicache_storage_backend = "0.5.23", "mooncake"
    stored = snapshot_from_sglang(worker.server_info(), models).isolation
    assert stored is not None and stored.field is None and "token-only" in stored.detail
    info = worker.server_info()
    del info["internal_states"][1]["memory_usage"]["token_capacity"]
    with pytest.raises(AdapterError, match=r"internal_states\[1\] has no token_capacity"):
        snapshot_from_sglang(info, models)
    del info["max_total_num_tokens"]
    with pytest.raises(AdapterError, match="max_total_num_tokens"):
        snapshot_from_sglang(info, models)


def test_vllm_metrics_to_pool() -> None:
    worker = VLLMWorker(core_pools=[9168, 8000])  # two data-parallel cores
    assert pool_from_metrics(worker.metrics()) == (8000, 16, None)
    worker.with_size_tokens = False  # before kv_cache_size_tokens: num_gpu_blocks is summed
    pool, _, reason = pool_from_metrics(worker.metrics())
    assert pool is None and reason is not None and "2 engine cores" in reason
    worker.core_pools = [9168]
    assert pool_from_metrics(worker.metrics()) == (9168, 16, None)  # 573 blocks * 16
    unprofiled = worker.metrics().replace('num_gpu_blocks="573"', 'num_gpu_blocks="None"')
    assert pool_from_metrics(unprofiled)[2] == "vllm:cache_config_info: KV cache not profiled yet"
    worker.log_stats = False
    assert pool_from_metrics(worker.metrics()) == (None, None, NO_STATS)
    with pytest.raises(AdapterError, match="not Prometheus text"):
        pool_from_metrics("vllm:cache_config_info{ 1\n")
    models = {"data": [{"id": "qwen3-32b", "max_model_len": 8192, "parent": None}]}
    with pytest.raises(AdapterError, match="does not list the configured model 'other'"):
        snapshot_from_vllm(models, worker.metrics(), wanted="other")


async def test_sglang_and_vllm_adapters_over_http() -> None:
    current, legacy = SGLangWorker(), SGLangWorker(legacy=True, version="0.5.5")
    vllm = VLLMWorker()
    servers = [await serve(sglang_app(current)), await serve(sglang_app(legacy))]
    servers += [await serve(vllm_app(vllm))]
    servers += [await serve(static_app({"/v1/models": (200, JSON, "[1, 2]")}))]
    s_url, legacy_url, v_url, broken_url = (server.url for server in servers)
    try:
        async with httpx.AsyncClient() as client:
            spec = EngineSpec(name="s", kind="sglang", base_url=s_url)
            snapshot = await adapter_for(spec).introspect(client, timeout=2)
            assert (snapshot.real_pool, snapshot.context_window) == (20480, 32768)
            assert snapshot.tokenize is not None and snapshot.tokenize.url.endswith("/v1/tokenize")
            assert current.traffic.hits("/get_server_info") == 0  # the deprecated path: never
            probe = {"model": current.model, "messages": [{"role": "user", "content": "kvguard"}]}
            assert current.traffic.tokenize_bodies == [probe]  # probed with a chat, as admitted
            spec = EngineSpec(name="old", kind="sglang", base_url=legacy_url)
            old = await adapter_for(spec).introspect(client, timeout=2)
            assert old.real_pool == 20480 and legacy.traffic.hits("/get_server_info") == 1
            assert old.isolation is not None and old.isolation.field is None
            spec = EngineSpec(name="v", kind="vllm", base_url=v_url, model="qwen3-32b")
            snapshot = await adapter_for(spec).introspect(client, timeout=2)
            assert (snapshot.real_pool, snapshot.model, snapshot.version) == (
                9168,
                "qwen3-32b",
                "0.33.0",
            )
            assert snapshot.tokenize is not None and snapshot.tokenize.url == f"{v_url}/tokenize"
            assert vllm.traffic.tokenize_bodies == [{**probe, "model": "qwen3-32b"}]
            messages = [{"role": "user", "content": "a b c"}]
            count = await adapter_for(spec).count_tokens(
                client, model="qwen3-32b", body={"messages": messages}, timeout=2, snapshot=snapshot
            )
            assert count == 3 + 3 and vllm.traffic.hits("/tokenize") == 2  # probe + count
            for kind, error in (("vllm", "not a JSON object"), ("sglang", "HTTP 404")):
                with pytest.raises(AdapterError, match=error):
                    spec = EngineSpec(name="b", kind=kind, base_url=broken_url)
                    await adapter_for(spec).introspect(client, timeout=2)
    finally:
        for server in servers:
            await server.stop()


async def test_bundled_adapter_and_exact_counts(standin) -> None:
    standin.controls.context_window, standin.controls.pool_tokens = 8192, 2048
    standin.controls.faults = ["legacy_handoff"]
    async with httpx.AsyncClient() as client:
        adapter = adapter_for(EngineSpec(name="b", base_url=standin.url))
        snapshot = await adapter.introspect(client, timeout=2)
        assert (snapshot.context_window, snapshot.real_pool, snapshot.max_request_tokens) == (
            8192,
            2048,
            2048,
        )
        assert snapshot.faults == ("legacy_handoff",) and snapshot.drift is not None
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c"}]
        count = await adapter.count_tokens(
            client, model="m", body={"messages": messages}, timeout=2
        )
        assert count == standin_count(messages=messages) == 11
        assert await adapter.count_tokens(client, model="m", body={"prompt": "x y"}, timeout=2) == 2

        wrong = adapter_for(EngineSpec(name="b", base_url=standin.url, model="other"))
        with pytest.raises(AdapterError, match="serves model 'standin-model'"):
            await wrong.introspect(client, timeout=2)
        standin.controls.capacity_status = 500
        with pytest.raises(AdapterError, match="HTTP 500"):
            await adapter.introspect(client, timeout=2)


async def test_bundled_adapter_refuses_other_schema_versions() -> None:
    report = {"schema_version": 1, "model": "m"}  # the release before engines named features
    server = await serve(static_app({"/engine/capacity": (200, JSON, json.dumps(report))}))
    invalid = await serve(static_app({"/engine/capacity": (200, JSON, '{"schema_version": 2}')}))
    try:
        async with httpx.AsyncClient() as client:
            with pytest.raises(AdapterError, match="schema_version 1 is not 2"):
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
        assert (snapshot.measured, snapshot.max_request_tokens, snapshot.model) == (
            False,
            1000,
            "hosted",
        )
        count = await adapter_for(spec).count_tokens(
            client, model="hosted", body={"prompt": "héllo"}, timeout=2
        )
    assert count == upper_bound_tokens("hosted", "héllo", None) == 6 + BYTES_PER_REQUEST
    two = [{"role": "user", "content": "ab"}]
    assert upper_bound_tokens(None, None, two) == BYTES_PER_REQUEST + BYTES_PER_MESSAGE + 4 + 2
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    async with httpx.AsyncClient() as client:
        with_tools = await adapter_for(spec).count_tokens(
            client, model="hosted", body={"messages": two, "tools": tools}, timeout=2
        )
    assert with_tools == upper_bound_tokens("hosted", None, two, definitions={"tools": tools})
    assert with_tools > upper_bound_tokens("hosted", None, two) + BYTES_PER_TOOLS
