"""STAND-INs for vLLM workers and vLLM's disaggregated-serving proxy (tests only; not vLLM).

Shapes follow these upstream sources, read from the vLLM 0.33.0 wheel (and the repository's
examples):

- worker: ``entrypoints/serve/engine/protocol.py`` (``ModelCard`` with ``max_model_len``,
  ``parent`` for LoRA; ``ErrorResponse`` = ``{"error": {message, type, param, code}}``),
  ``entrypoints/serve/tokenize/api_router.py`` (``POST /tokenize`` only, no ``/v1/tokenize``;
  ``{count, max_model_len, tokens}``; a chat's ``tools`` and ``chat_template_kwargs`` are rendered
  with it, ``serve/tokenize/protocol.py`` ``TokenizeChatRequest``; the chat route renders the
  request's tools and the template kwargs ``openai/chat_completion/protocol.py``
  ``build_chat_params`` derives, ``renderers/online_renderer.py`` ``render_chat``),
  ``entrypoints/serve/instrumentator/basic.py`` (``GET /version``), ``v1/metrics/loggers.py``
  ``log_metrics_info`` (``vllm:cache_config_info``: ``CacheConfig`` fields as labels, one sample
  per engine core, among them ``block_size``,
  ``num_gpu_blocks`` (summed over data-parallel cores, ``v1/engine/core_client.py``) and
  ``kv_cache_size_tokens`` (per core)); ``log_stats=False`` (``--disable-log-stats``) serves
  ``/metrics`` without any ``vllm:`` family. Stream chunks as
  ``entrypoints/openai/chat_completion/serving.py`` writes them (first chunk carries the role,
  choices carry ``stop_reason``; usage chunk has ``choices: []``).
- ``PDProxy``: ``examples/online_serving/disaggregated_serving/disagg_proxy_demo.py``: the request
  goes to a prefill instance with ``max_tokens=1`` first, then to a decode instance whose answer is
  streamed back; ``GET /status`` lists the instances; no ``/v1/models``, ``/metrics`` or tokenize.
  ``forward_request`` relays a worker's 2xx and 4xx bodies alike, so a decode worker's 400
  ``ErrorResponse`` reaches the caller as HTTP 200 (``StreamingResponse(...,
  media_type="application/json")``, streamed or not); a 5xx becomes FastAPI's ``{"detail"}``.
- embeddings (``embed=True``: a model with the ``embed`` pooling task): ``POST /v1/embeddings``
  as ``entrypoints/pooling/embed/api_router.py`` and ``embed/protocol.py`` answer it
  (``EmbeddingResponse``: ``id`` "embd-...", ``object`` "list", ``created``, ``model``, ``data``
  of ``EmbeddingResponseData`` {index, object "embedding", embedding}, ``usage`` ``UsageInfo``
  {prompt_tokens, total_tokens, completion_tokens 0, prompt_tokens_details null}); the route is
  registered only for a model with that task (``entrypoints/pooling/__init__.py``
  ``register_pooling_api_routers``), so a generative model answers FastAPI's 404
  ``{"detail": "Not Found"}`` there, as the real server does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from standin_openai import (
    Deployment,
    Script,
    Traffic,
    answer_words,
    chunks,
    embedding_data,
    full_body,
    prompt_text,
    serve_workers,
    sse,
    word_count,
)

from kvguard.testing import serve

VERSION = "0.33.0"


@dataclass
class VLLMWorker:
    model: str = "qwen3-32b"
    max_model_len: int = 8192
    block_size: int = 16
    core_pools: list[int] = field(default_factory=lambda: [9168])  # kv_cache_size_tokens per core
    with_size_tokens: bool = True  # False: a release before kv_cache_size_tokens
    log_stats: bool = True
    version: str = VERSION
    status: int = 200
    refuse: str | None = None  # completions answer vLLM's 400 ErrorResponse with this message
    embed: bool = False  # a pooling model with the embed task: /v1/embeddings is served
    dimensions: int = 8
    script: Script = field(default_factory=Script)
    traffic: Traffic = field(default_factory=Traffic)

    def metrics(self) -> str:
        lines = ["# HELP python_gc_objects_collected_total Objects collected during gc"]
        lines.append("# TYPE python_gc_objects_collected_total counter")
        lines.append('python_gc_objects_collected_total{generation="0"} 1.0')
        if not self.log_stats:
            return "\n".join(lines) + "\n"
        summed = sum(pool // self.block_size for pool in self.core_pools)
        lines.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        lines.append("# TYPE vllm:cache_config_info gauge")
        for engine, pool in enumerate(self.core_pools):
            labels = {
                "block_size": str(self.block_size),
                "cache_dtype": "auto",
                "enable_prefix_caching": "True",
                "gpu_memory_utilization": "0.9",
                "num_gpu_blocks": str(summed),
                "num_gpu_blocks_override": "None",
            }
            if self.with_size_tokens:
                labels["kv_cache_size_tokens"] = str(pool)
                labels["kv_cache_max_concurrency"] = f"{pool / self.max_model_len:.2f}"
            text = ",".join(f'{k}="{v}"' for k, v in {**labels, "engine": str(engine)}.items())
            lines.append(f"vllm:cache_config_info{{{text}}} 1.0")
        return "\n".join(lines) + "\n"


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    error = {"message": message, "type": "BadRequestError", "param": param, "code": status}
    return JSONResponse({"error": error}, status_code=status)


def chat_tokens(body: dict[str, Any]) -> int:
    """The prompt the chat route renders: the tools always (off by default:
    ``--exclude-tools-when-tool-choice-none``), thinking off when ``reasoning_effort`` is "none"
    (``ChatCompletionRequest.build_chat_params`` sets ``enable_thinking`` from it;
    ``reasoning_effort`` itself is a template variable this template does not use)."""
    return word_count(
        body.get("prompt"),
        body.get("messages"),
        tools=body.get("tools"),
        thinking=body.get("reasoning_effort") != "none",
    )


def worker_app(w: VLLMWorker) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        w.traffic.paths.append(request.url.path)
        w.traffic.headers.append({k.lower(): v for k, v in request.headers.items()})
        if w.status != 200:
            return JSONResponse({"detail": "sick"}, status_code=w.status)
        response: Response = await call_next(request)
        return response

    @app.get("/v1/models")
    async def models() -> Any:
        card = {"id": w.model, "object": "model", "owned_by": "vllm", "root": f"/models/{w.model}"}
        return {
            "object": "list",
            "data": [{**card, "parent": None, "max_model_len": w.max_model_len, "permission": []}],
        }

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(w.metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> Any:
        return {"version": w.version}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        body = await request.json()
        w.traffic.tokenize_bodies.append(body)
        template_kwargs = body.get("chat_template_kwargs") or {}
        count = word_count(
            body.get("prompt"),
            body.get("messages"),
            tools=body.get("tools"),  # TokenizeChatRequest.tools: rendered as the chat route does
            thinking=template_kwargs.get("enable_thinking") is not False,
        )
        return {"count": count, "max_model_len": w.max_model_len, "tokens": list(range(count))}

    if w.embed:

        @app.post("/v1/embeddings")
        async def embeddings(request: Request) -> Any:
            body = await request.json()
            w.traffic.bodies.append(body)
            if w.refuse is not None:
                return _error(400, w.refuse)
            data, tokens = embedding_data(body, w.dimensions)
            usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
            return {
                "id": f"embd-{len(w.traffic.bodies)}",
                "object": "list",
                "created": 0,
                "model": w.model,
                "data": data,
                "usage": {**usage, "prompt_tokens_details": None},
            }

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def complete(request: Request) -> Any:
        body = await request.json()
        w.traffic.bodies.append(body)
        if w.refuse is not None:
            return _error(400, w.refuse)
        w.traffic.prompts.append(prompt_text(body))
        salt = body.get("cache_salt")
        if salt is not None and (len(salt) > 128 or any(c in salt for c in "@/\\\0")):
            return _error(
                400, "Parameter 'cache_salt' must be at most 128 characters", "cache_salt"
            )
        tokens = chat_tokens(body)
        if tokens + int(body.get("max_tokens") or 16) > w.max_model_len:
            return _error(400, f"This model's maximum context length is {w.max_model_len} tokens.")
        words = answer_words(body, w.script, w.traffic)
        if body.get("stream"):
            objs = chunks(
                body, words, tokens, w.script, model=w.model, extra_choice={"stop_reason": None}
            )
            return StreamingResponse(sse(objs), media_type="text/event-stream")
        return full_body(body, words, tokens, w.script, model=w.model)

    return app


@dataclass
class PDProxy:
    prefill: list[str]  # "host:port", as the demo takes --prefill / --decode
    decode: list[str]
    traffic: Traffic = field(default_factory=Traffic)

    def __post_init__(self) -> None:
        self._p, self._d = itertools.cycle(self.prefill), itertools.cycle(self.decode)


def proxy_app(p: PDProxy) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=30)

    @app.get("/status")
    async def status() -> Any:
        return {
            "prefill_node_count": len(p.prefill),
            "decode_node_count": len(p.decode),
            "prefill_nodes": p.prefill,
            "decode_nodes": p.decode,
        }

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def complete(request: Request) -> Any:
        p.traffic.paths.append(request.url.path)
        body = await request.json()
        path = request.url.path
        kv_prepare = {**body, "max_tokens": 1, "stream": False}
        await client.post(f"http://{next(p._p)}{path}", json=kv_prepare)
        upstream = client.build_request("POST", f"http://{next(p._d)}{path}", json=body)
        opened = await client.send(upstream, stream=True)
        if opened.status_code >= 500:
            await opened.aread()
            detail = f"Request failed with status {opened.status_code}: {opened.text}"
            return JSONResponse({"detail": detail}, status_code=opened.status_code)
        return StreamingResponse(opened.aiter_raw(), media_type="application/json")

    return app


@dataclass
class VLLMRouted(Deployment):
    proxy: PDProxy = field(kw_only=True)
    workers: dict[str, VLLMWorker] = field(kw_only=True)


async def start_vllm_routed(workers: dict[str, tuple[str, VLLMWorker]]) -> VLLMRouted:
    """Workers by name -> (role, worker), behind the PD proxy demo."""
    plain = {name: worker for name, (_, worker) in workers.items()}
    servers, urls = await serve_workers({name: worker_app(w) for name, w in plain.items()})
    roles = {name: role for name, (role, _) in workers.items()}
    proxy = PDProxy(
        prefill=[urls[n].removeprefix("http://") for n, r in roles.items() if r == "prefill"],
        decode=[urls[n].removeprefix("http://") for n, r in roles.items() if r == "decode"],
    )
    proxy_server = await serve(proxy_app(proxy))
    return VLLMRouted(proxy_server, urls, roles, servers, proxy=proxy, workers=plain)
