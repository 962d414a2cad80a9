"""SGLang and vLLM deployments behind routers, registered as engine groups the way docs/engines
tells an operator to, against stand-ins that follow the upstream sources (standin_sglang,
standin_vllm) and, for SGLang's model gateway, the real router (sglang-router): the enforced limit
is the smallest pool of every member, one sick member fails the group closed with a reason naming
it, token counts come from the endpoint the worker serves, the tenant's prefix-cache salt replaces
the client's (where the router passes it on), and requests stream through the canary firewall and
into the audit."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from gateway_harness import bearer, running_gateway
from sqlalchemy import select
from standin_openai import Script, Traffic, serve_workers
from standin_sglang import SGLangWorker, start_sglang_pd
from standin_sglang import worker_app as sglang_worker_app
from standin_vllm import VLLMWorker, start_vllm_routed

from canary.config import CanarySettings
from canary.runtime import CanaryRuntime
from contracts.sql import session_scope
from gateway.db.models import RequestAudit
from gateway.engines.isolation import tenant_salt
from kvguard.localservices import free_port
from kvguard.testing import serve

CANARY_KEY = "canary-test-key-0123456789abcdef0123456789"


def _toml(name: str, kind: str, url: str, members: list[dict[str, Any]], extra: str = "") -> str:
    """The engines file an operator writes for a deployment (docs/engines.md)."""
    text = f'[[engines]]\nname = "{name}"\nkind = "{kind}"\nbase_url = "{url}"\n{extra}'
    for m in members:
        text += f'\n[[engines.members]]\nname = "{m["name"]}"\nrole = "{m["role"]}"\n'
        text += f'url = "{m["url"]}"\n' + "".join(
            f"{k} = {v}\n" for k, v in m.items() if k not in ("name", "role", "url")
        )
    return text


def _chat(model: str, words: int, *, stream: bool = True, **extra: Any) -> dict[str, Any]:
    content = " ".join(["word"] * words)
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "stream": stream,
        **extra,
    }


def _text(raw: str) -> str:
    out = []
    for block in raw.split("\n\n"):
        data = block.removeprefix("data: ").strip()
        if data.startswith("{"):
            for choice in json.loads(data).get("choices", []):
                out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)


async def _engine(gw: Any, name: str) -> dict[str, Any]:
    r = await gw.client.get("/admin/engines", headers=gw.admin)
    return next(e for e in r.json() if e["name"] == name)


async def _audit(gw: Any) -> list[RequestAudit]:
    await gw.state.audit.flush()
    with session_scope(gw.state.sessions) as session:
        return list(session.scalars(select(RequestAudit).order_by(RequestAudit.id)))


def _canary_hooks() -> Any:
    return CanaryRuntime(CanarySettings(canary_key=CANARY_KEY)).hooks()


async def test_sglang_pd_group_behind_the_model_gateway(make_settings, tmp_path: Path) -> None:
    shared = Traffic()  # the decode workers' pages: a leak there reaches any of them
    workers = {
        "p1": SGLangWorker(mode="prefill", rank_pools=[3000], context_len=4096),
        "p2": SGLangWorker(mode="prefill", rank_pools=[2600, 2400]),  # DP: rank 1 is smaller
        "d1": SGLangWorker(mode="decode", rank_pools=[4000], traffic=shared),
        "d2": SGLangWorker(mode="decode", rank_pools=[1800], traffic=shared),
    }
    pd = await start_sglang_pd(workers, flavor="model_gateway")
    try:
        engines = tmp_path / "engines.toml"
        engines.write_text(_toml("sglang-pd", "sglang", pd.url, pd.members()))
        settings = make_settings(engines_file=engines)
        async with running_gateway(settings, hooks=_canary_hooks()) as gw:
            view = await _engine(gw, "sglang-pd")
            assert view["routable"], view
            assert view["max_request_tokens"] == 1800  # d2's pool: the smallest on any path
            assert {r["role"]: r["pool_tokens"] for r in view["roles"]} == {
                "p1/prefill": 3000,
                "p2/prefill": 2400,
                "d1/decode": 4000,
                "d2/decode": 1800,
            }
            assert view["tokenize_url"] == f"{pd.urls['p1']}/v1/tokenize"
            # every member honours cache_salt, but the model gateway drops it from what it
            # sends them (as the real one does: test_sglang_pd_group_behind_the_real_router)
            isolation = view["prefix_cache_isolation"]
            assert (isolation["supported"], isolation["field"]) == (False, None)
            assert (
                "SGLang model gateway in front of the members drops cache_salt"
                in (isolation["detail"])
            )
            for worker in workers.values():  # /server_info, never the deprecated path
                assert worker.traffic.hits("/get_server_info") == 0
                assert worker.traffic.hits("/server_info") >= 1

            _, victim_key = await gw.create_tenant("victim", canary_sample_rate=1.0)
            _, observer_key = await gw.create_tenant("observer")
            model = workers["p1"].model
            too_long = await gw.client.post(
                "/v1/chat/completions", json=_chat(model, 1790), headers=bearer(victim_key)
            )  # 1790 words + 3 frame + 8 max_tokens = 1801 > 1800
            assert too_long.status_code == 400
            assert too_long.json()["error"]["code"] == "context_length_exceeded"
            assert "maximum context length is 1800 tokens" in too_long.json()["error"]["message"]

            r = await gw.client.post(
                "/v1/chat/completions",
                json=_chat(model, 20, cache_salt="the-client-chose-this"),
                headers=bearer(victim_key),
            )
            assert r.status_code == 200 and "[DONE]" in r.text
            assert _text(r.text) == " ".join(["word"] * 8)  # echoed up to max_tokens
            assert "cache_salt" not in shared.bodies[-1]  # no salt claimed where none arrives
            assert "the-client-chose-this" not in str(shared.bodies)
            assert pd.router.traffic.hits("/v1/tokenize") == 0  # counted on p1, with messages
            assert workers["p1"].traffic.hits("/v1/tokenize") >= 2

            for worker in ("d1", "d2"):  # SGLang's own 400 (a flat body) reaches the client
                workers[worker].refuse = "Requested token count exceeds the model's maximum"
            refused = await gw.client.post(
                "/v1/chat/completions", json=_chat(model, 5), headers=bearer(observer_key)
            )
            assert refused.status_code == 400, refused.text
            assert "Requested token count exceeds" in refused.json()["error"]["message"]
            for worker in ("d1", "d2"):
                workers[worker].refuse = None
                workers[worker].script = Script(leak_previous=True)
            leak = await gw.client.post(
                "/v1/chat/completions", json=_chat(model, 5), headers=bearer(observer_key)
            )
            assert leak.status_code == 200 and "isolation_violation" in leak.text
            assert "CNRY-" not in leak.text

            rows = await _audit(gw)
            assert [(row.engine, row.outcome) for row in rows[-3:]] == [
                ("sglang-pd", "completed"),
                ("sglang-pd", "rejected"),
                ("sglang-pd", "cut"),
            ]
            assert rows[-3].prompt_tokens is not None and rows[-3].prompt_tokens > 20

            await gw.client.delete("/admin/engines/sglang-pd/quarantine", headers=gw.admin)
            workers["d2"].status = 500  # one decode worker stops answering its introspection
            await gw.state.poller.poll_once()
            view = await _engine(gw, "sglang-pd")
            assert (view["routable"], view["blocked_reason"]) == (False, "unreachable")
            assert "member 'd2' (decode" in view["blocked_detail"]
            refused = await gw.client.post(
                "/v1/chat/completions", json=_chat(model, 5), headers=bearer(observer_key)
            )
            assert refused.status_code == 503
            assert pd.url not in refused.text and "d2" not in refused.text
    finally:
        await pd.stop()


async def test_sglang_pd_group_behind_mini_lb_gets_the_tenant_salt(
    make_settings, tmp_path: Path
) -> None:
    """mini_lb passes each request on as it came, so the members' cache_salt holds through it."""
    workers = {
        "p1": SGLangWorker(mode="prefill", rank_pools=[3000]),
        "d1": SGLangWorker(mode="decode", rank_pools=[2000]),
    }
    pd = await start_sglang_pd(workers, flavor="mini_lb")
    try:
        engines = tmp_path / "engines.toml"
        engines.write_text(_toml("sglang-mini", "sglang", pd.url, pd.members()))
        async with running_gateway(make_settings(engines_file=engines)) as gw:
            view = await _engine(gw, "sglang-mini")
            assert view["routable"] and view["max_request_tokens"] == 2000, view
            assert view["prefix_cache_isolation"]["field"] == "cache_salt"
            tenant, key = await gw.create_tenant("acme")
            body = _chat(workers["p1"].model, 5, cache_salt="the-client-chose-this")
            r = await gw.client.post("/v1/chat/completions", json=body, headers=bearer(key))
            assert r.status_code == 200 and "[DONE]" in r.text
            salt = tenant_salt(gw.state.settings.cache_salt_secret(), tenant)
            assert workers["d1"].traffic.bodies[-1]["cache_salt"] == salt
            assert "the-client-chose-this" not in str(workers["d1"].traffic.bodies)
    finally:
        await pd.stop()


def _real_router(pd_urls: dict[str, str], roles: dict[str, str], log: Path) -> tuple[Any, str]:
    """SGLang's real model gateway (sglang-router, the package's own CLI) in front of the
    workers, once it has found every one of them healthy."""
    port = free_port()
    argv = [str(Path(sys.executable).parent / "sglang-router"), "launch", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--pd-disaggregation", "--log-level", "warn"]
    for name, url in pd_urls.items():
        argv += ["--prefill", url, "none"] if roles[name] == "prefill" else ["--decode", url]
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline, "the router found no healthy workers in 60 s"
        try:
            listed = httpx.get(url + "/workers", timeout=2).json()["workers"]
            if len(listed) == len(pd_urls) and all(w["is_healthy"] for w in listed):
                return proc, url
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.1)  # polling the router's own worker list, with a deadline


async def test_sglang_pd_group_behind_the_real_router(make_settings, tmp_path: Path) -> None:
    """The real SGLang model gateway (sglang-router 0.3.2) over worker stand-ins, registered as
    docs/engines.md says, both ways: the limit is the smallest member pool, counts come from a
    prefill member (the router's /v1/tokenize takes no chat), requests stream through the router
    and the canary firewall, and the router's dropping of cache_salt is reported, not papered
    over (what it sends the workers carries no salt)."""
    shared = Traffic()
    workers = {
        "p1": SGLangWorker(mode="prefill", rank_pools=[3000]),
        "p2": SGLangWorker(mode="prefill", rank_pools=[2600, 2400]),
        "d1": SGLangWorker(mode="decode", rank_pools=[4000], traffic=shared),
        "d2": SGLangWorker(mode="decode", rank_pools=[1800], traffic=shared),
    }
    servers, urls = await serve_workers({n: sglang_worker_app(w) for n, w in workers.items()})
    roles = {name: worker.mode for name, worker in workers.items()}
    proc, router = await asyncio.to_thread(_real_router, urls, roles, tmp_path / "router.log")
    try:
        members = [{"name": n, "role": roles[n], "url": u} for n, u in urls.items()]
        engines = tmp_path / "engines.toml"
        engines.write_text(
            _toml("listed", "sglang", router, members)
            + _toml("found", "sglang", router, members, "discover_members = true\n")
        )
        settings = make_settings(engines_file=engines)
        async with running_gateway(settings, hooks=_canary_hooks()) as gw:
            for name in ("listed", "found"):
                view = await _engine(gw, name)
                assert view["routable"], view
                assert view["max_request_tokens"] == 1800  # d2's pool
                assert view["tokenize_url"] == f"{urls['p1']}/v1/tokenize"
                isolation = view["prefix_cache_isolation"]
                assert isolation["supported"] is False
                assert "drops cache_salt" in isolation["detail"]

            _, key = await gw.create_tenant("acme", canary_sample_rate=1.0)
            model = workers["p1"].model
            body = _chat(model, 20, cache_salt="the-client-chose-this")
            r = await gw.client.post("/v1/chat/completions", json=body, headers=bearer(key))
            assert r.status_code == 200 and "[DONE]" in r.text, r.text
            assert _text(r.text) == " ".join(["word"] * 8)
            sent = shared.bodies[-1]  # what the real router sent a decode worker
            assert "bootstrap_room" in sent  # its PD dispatch, not a pass-through
            assert "cache_salt" not in sent and "the-client-chose-this" not in str(shared.bodies)

            _, other_key = await gw.create_tenant("other")
            for worker in ("d1", "d2"):
                workers[worker].script = Script(leak_previous=True)
            leak = await gw.client.post(
                "/v1/chat/completions", json=_chat(model, 5), headers=bearer(other_key)
            )
            assert leak.status_code == 200 and "isolation_violation" in leak.text
            assert "CNRY-" not in leak.text
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for server in servers:
            await server.stop()


async def test_sglang_router_alone_is_refused_with_the_fix(make_settings) -> None:
    workers = {
        "p1": SGLangWorker(mode="prefill", rank_pools=[3000]),
        "d1": SGLangWorker(mode="decode", rank_pools=[1000]),
    }
    gateway_pd = await start_sglang_pd(workers, flavor="model_gateway")
    mini = await start_sglang_pd(
        {"p": SGLangWorker(mode="prefill"), "d": SGLangWorker(mode="decode")}, flavor="mini_lb"
    )
    replicas = await start_sglang_pd(  # the model gateway over regular (non-PD) workers
        {"r1": SGLangWorker(rank_pools=[5000]), "r2": SGLangWorker(rank_pools=[2000])}
    )
    try:
        regular = {"name": "regular", "kind": "sglang", "base_url": replicas.url}
        settings = make_settings(
            engines=[
                {"name": "smg", "kind": "sglang", "base_url": gateway_pd.url},
                {"name": "mini", "kind": "sglang", "base_url": mini.url},
                regular,
                {**regular, "name": "regular-found", "discover_members": True},
            ]
        )
        async with running_gateway(settings) as gw:
            smg = await _engine(gw, "smg")
            assert smg["blocked_reason"] == "unavailable"  # it shows only p1: d1 is unseen
            assert "listing every prefill and decode worker as members" in smg["blocked_detail"]
            mini_view = await _engine(gw, "mini")
            assert mini_view["blocked_reason"] == "unreachable"
            assert "no tokenize endpoint" in mini_view["blocked_detail"]
            assert "register its workers as members" in mini_view["blocked_detail"]
            # it shows r1's pool only, and its /v1/tokenize counts no chat: never routable
            view = await _engine(gw, "regular")
            assert view["blocked_reason"] == "unavailable", view
            assert "is a router (GET /workers lists 2 workers: unified;" in view["blocked_detail"]
            assert "listing every worker as members" in view["blocked_detail"]
            found = await _engine(gw, "regular-found")  # the fix the detail names
            assert found["routable"] and found["max_request_tokens"] == 2000
            assert found["tokenize_url"] == f"{replicas.urls['r1']}/v1/tokenize"
    finally:
        await gateway_pd.stop()
        await mini.stop()
        await replicas.stop()


async def test_vllm_deployment_behind_the_pd_proxy(make_settings, tmp_path: Path) -> None:
    decoded = Traffic()
    routed = await start_vllm_routed(
        {
            "prefill-0": ("prefill", VLLMWorker(core_pools=[12000])),
            "decode-0": ("decode", VLLMWorker(core_pools=[9168], traffic=decoded)),
            "decode-1": ("decode", VLLMWorker(core_pools=[6000, 7000], traffic=decoded)),
        }
    )
    try:
        engines = tmp_path / "engines.toml"
        engines.write_text(_toml("vllm-pd", "vllm", routed.url, routed.members()))
        settings = make_settings(engines_file=engines)
        async with running_gateway(settings, hooks=_canary_hooks()) as gw:
            view = await _engine(gw, "vllm-pd")
            assert view["routable"] and view["max_request_tokens"] == 6000
            assert view["tokenize_url"] == f"{routed.urls['prefill-0']}/tokenize"
            assert view["prefix_cache_isolation"]["field"] == "cache_salt"
            tenant, key = await gw.create_tenant("acme", canary_sample_rate=1.0)
            _, observer_key = await gw.create_tenant("observer")
            body = _chat("qwen3-32b", 12, cache_salt="the-client-chose-this")
            r = await gw.client.post("/v1/chat/completions", json=body, headers=bearer(key))
            assert r.status_code == 200 and '"stop_reason"' in r.text
            salt = decoded.bodies[-1]["cache_salt"]
            assert salt == tenant_salt(gw.state.settings.cache_salt_secret(), tenant)
            received = routed.workers["prefill-0"].traffic.bodies + decoded.bodies
            assert len(received) == 2  # the proxy's KV-prepare on prefill-0, the decode request
            assert "the-client-chose-this" not in json.dumps(received)
            assert len(salt) <= 128 and not set(salt) & set("@/\\\0")
            assert routed.workers["prefill-0"].traffic.hits("/tokenize") >= 2  # probe + count
            rows = await _audit(gw)
            assert (rows[-1].engine, rows[-1].outcome, rows[-1].prompt_tokens) == (
                "vllm-pd",
                "completed",
                12 + 3,
            )

            decoders = [routed.workers[name] for name in ("decode-0", "decode-1")]
            for worker in decoders:  # vLLM's ErrorResponse, relayed by the proxy as HTTP 200
                worker.refuse = "This model's maximum context length is 8192 tokens."
            for stream in (True, False):
                refused = await gw.client.post(
                    "/v1/chat/completions",
                    json=_chat("qwen3-32b", 5, stream=stream),
                    headers=bearer(observer_key),
                )
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert error["message"] == "This model's maximum context length is 8192 tokens."
                assert error["type"] == "BadRequestError"
            for worker in decoders:
                worker.refuse = None
                worker.script = Script(leak_previous=True)
            leak = await gw.client.post(
                "/v1/chat/completions", json=_chat("qwen3-32b", 5), headers=bearer(observer_key)
            )  # decode answers with acme's marked prompt: the firewall cuts it
            assert leak.status_code == 200 and "isolation_violation" in leak.text
            assert "CNRY-" not in leak.text
            rows = await _audit(gw)
            assert [(row.engine, row.outcome) for row in rows[-3:]] == [
                ("vllm-pd", "rejected"),
                ("vllm-pd", "rejected"),
                ("vllm-pd", "cut"),
            ]

            await gw.client.delete("/admin/engines/vllm-pd/quarantine", headers=gw.admin)
            routed.workers["decode-1"].log_stats = False  # --disable-log-stats on one worker
            await gw.state.poller.poll_once()
            view = await _engine(gw, "vllm-pd")
            assert view["blocked_reason"] == "unknown_capacity"
            assert view["blocked_detail"].startswith("decode-1/unified: /metrics has no")
            assert "--disable-log-stats" in view["blocked_detail"]
    finally:
        await routed.stop()


async def test_vllm_pd_proxy_alone_is_refused_with_the_fix(make_settings) -> None:
    routed = await start_vllm_routed(
        {
            "prefill-0": ("prefill", VLLMWorker(core_pools=[12000])),
            "decode-0": ("decode", VLLMWorker(core_pools=[7000])),
        }
    )
    try:
        alone = {"name": "alone", "kind": "vllm", "base_url": routed.url}
        settings = make_settings(
            engines=[alone, {**alone, "name": "found", "discover_members": True}]
        )
        async with running_gateway(settings) as gw:
            view = await _engine(gw, "alone")  # the proxy serves no /v1/models
            assert view["blocked_reason"] == "unreachable"
            assert view["blocked_detail"].startswith("GET /v1/models: HTTP 404: ")
            assert "this URL looks like a router" in view["blocked_detail"]
            assert "list the vLLM workers as members" in view["blocked_detail"]
            assert "discover_members = true" in view["blocked_detail"]
            found = await _engine(gw, "found")  # the fix the detail names
            assert found["routable"] and found["max_request_tokens"] == 7000
    finally:
        await routed.stop()


async def test_vllm_without_stats_routes_only_on_a_consistent_declared_pool(make_settings) -> None:
    low = await start_vllm_routed({"w": ("unified", VLLMWorker(log_stats=False))})
    old_dp = await start_vllm_routed(
        {"w": ("unified", VLLMWorker(core_pools=[9000, 9000], with_size_tokens=False))}
    )
    try:
        url = low.urls["w"]
        settings = make_settings(
            engines=[
                {"name": "declared", "kind": "vllm", "base_url": url, "declared_pool_tokens": 9000},
                {"name": "too-low", "kind": "vllm", "base_url": url, "declared_pool_tokens": 4096},
                {"name": "old-dp", "kind": "vllm", "base_url": old_dp.urls["w"]},
            ]
        )
        async with running_gateway(settings) as gw:
            declared = await _engine(gw, "declared")
            assert declared["routable"] and declared["max_request_tokens"] == 8192
            assert declared["roles"][0]["pool_declared"] is True
            too_low = await _engine(gw, "too-low")
            assert too_low["blocked_reason"] == "unknown_capacity"
            assert "below the worker's max_model_len 8192" in too_low["blocked_detail"]
            dp = await _engine(gw, "old-dp")
            assert "2 engine cores share one summed num_gpu_blocks" in dp["blocked_detail"]
    finally:
        await low.stop()
        await old_dp.stop()


async def test_group_registered_through_the_admin_api(make_settings) -> None:
    workers = {
        "p": SGLangWorker(mode="prefill", rank_pools=[5000], context_len=4096),
        "d": SGLangWorker(mode="decode", rank_pools=[3000], context_len=4096),
    }
    pd = await start_sglang_pd(workers)
    try:
        async with running_gateway(make_settings()) as gw:
            entry = {"name": "pd", "kind": "sglang", "base_url": pd.url, "members": pd.members()}
            r = await gw.client.post("/admin/engines", json=entry, headers=gw.admin)
            assert r.status_code == 201, r.text
            assert r.json()["routable"] and r.json()["max_request_tokens"] == 3000
            assert [m["name"] for m in r.json()["members"]] == ["p", "d"]
            await gw.state.reload_engines()  # read back from the database, as a replica does
            await gw.state.poller.poll_once()
            assert (await _engine(gw, "pd"))["max_request_tokens"] == 3000
            bad = {**entry, "name": "pd2", "members": [{**pd.members()[1]}]}
            r = await gw.client.post("/admin/engines", json=bad, headers=gw.admin)
            assert r.status_code == 400 and "prefill or unified member" in r.text
    finally:
        await pd.stop()


async def test_router_worker_lists_keep_members_complete(make_settings) -> None:
    workers = {
        "p1": SGLangWorker(mode="prefill", rank_pools=[5000], context_len=4096),
        "d1": SGLangWorker(mode="decode", rank_pools=[3000], context_len=4096),
    }
    pd = await start_sglang_pd(workers)
    late = SGLangWorker(mode="decode", rank_pools=[900], context_len=4096)
    late_server = await serve(sglang_worker_app(late))
    routed = await start_vllm_routed(
        {
            "prefill-0": ("prefill", VLLMWorker(core_pools=[12000])),
            "decode-0": ("decode", VLLMWorker(core_pools=[7000])),
        }
    )
    try:
        listed = {"name": "listed", "kind": "sglang", "base_url": pd.url, "members": pd.members()}
        settings = make_settings(
            engines=[
                {**listed, "discover_members": True},
                {"name": "found", "kind": "sglang", "base_url": pd.url, "discover_members": True},
                {"name": "vllm", "kind": "vllm", "base_url": routed.url, "discover_members": True},
            ]
        )
        async with running_gateway(settings) as gw:
            assert (await _engine(gw, "listed"))["max_request_tokens"] == 3000
            found = await _engine(gw, "found")
            assert [m["name"] for m in found["members"]] == []  # none configured ...
            assert {r["role"] for r in found["roles"]} == {"prefill-0/prefill", "decode-1/decode"}
            vllm = await _engine(gw, "vllm")  # ... the routers' lists are the members
            assert vllm["routable"] and vllm["max_request_tokens"] == 7000

            pd.router.add(late_server.url, "decode")  # scaled out behind the gateway's back
            await gw.state.poller.poll_once()
            listed_view = await _engine(gw, "listed")
            assert listed_view["blocked_reason"] == "unreachable"
            assert (
                f"routes to decode worker {late_server.url}, which is not a member"
                in (listed_view["blocked_detail"])
            )
            found = await _engine(gw, "found")
            assert found["routable"] and found["max_request_tokens"] == 900  # measured at once
    finally:
        await pd.stop()
        await late_server.stop()
        await routed.stop()
