"""STAND-INs for SGLang workers and the routers in front of them (tests only; not SGLang).

Shapes follow these upstream sources, read from the released packages:

- worker: SGLang 0.5.23, ``python/sglang/srt/entrypoints/http_server.py`` (``/server_info``;
  ``/get_server_info`` deprecated alias that logs a warning; ``/model_info``; ``/v1/models`` with
  ``ModelCard.max_model_len``; ``/v1/tokenize`` and ``/tokenize`` answering ``TokenizeResponse``
  ``{tokens, count, max_model_len}``; ``entrypoints/openai/protocol.py`` ``TokenizeRequest`` keeps
  unknown fields and ``serving_tokenize.py`` renders ``messages`` as a chat completion of the whole
  body: the tools as ``serving_chat.py`` renders them, none for ``tool_choice`` "none", only the
  named one), ``srt/utils/common.py`` ``build_server_info`` (resolved
  server args + scheduler handshake ``max_total_num_tokens``/``max_req_input_len`` = rank 0),
  ``srt/managers/scheduler_components/internal_state.py`` + ``memory_usage.py`` (one
  ``internal_states`` entry per DP rank, pool in ``memory_usage.token_capacity``), errors from
  ``srt/entrypoints/openai/serving_base.py`` ``create_error_response`` (a flat
  ``{"object": "error", "message", "type", "param", "code"}``, not OpenAI's nested ``error``).
  ``legacy=True`` answers like 0.5.5 (no ``/server_info``). Before 0.5.12 (by ``version``) the
  tokenize routes take prompt strings only: ``TokenizeRequest`` has a required ``prompt`` and no
  ``messages``, so a chat is a validation error, which ``http_server.py``'s
  ``validation_exception_handler`` answers as a 400 flat ``ErrorResponse``.
- ``MiniLB``: sglang-router 0.3.2, ``sglang_router/mini_lb.py`` (``/get_server_info`` =
  ``{"internal_states": decode ranks', "prefill": [infos], "decode": [infos]}``; ``/v1/models``
  from the first prefill; completions sent to a prefill and a decode worker, the decode answer
  returned; no tokenize route).
- ``ModelGatewayRouter``: the SGLang model gateway (Shepherd Model Gateway 1.9.0, commit
  73da68ca of lightseekorg/smg), ``model_gateway/src/server.rs`` and
  ``routers/http/pd_router.rs``: ``/get_server_info`` proxied to the FIRST prefill worker only;
  ``/v1/tokenize`` (router-side tokenizer, ``{model, prompt}`` only: no chat messages) and no
  ``/tokenize``; ``/v1/models``; ``GET /workers`` (``crates/protocols/src/worker.rs``
  ``WorkerListResponse``: ``WorkerInfo`` with the flattened ``WorkerSpec``: ``url``,
  ``worker_type`` prefill/decode/regular, ``bootstrap_port``...), to which workers can be added
  at run time; chat/completions dual-dispatched to a prefill/decode pair. Over regular (non-PD)
  workers (``routers/http/router.rs``): ``/get_server_info`` and ``/v1/models`` proxied to the
  first worker (``proxy_get_request``), the same router-side ``/v1/tokenize`` and
  ``GET /workers``, completions sent to one worker. Not modelled: the real sglang-router 0.3.2
  model gateway rebuilds each request from its own schema (it drops ``cache_salt``, sends
  ``max_completion_tokens`` for ``max_tokens``, adds its bootstrap fields) and answers
  ``/get_server_info`` with its own ``{"router_manager": true, ...}``; the engine-group tests run
  that real router in front of these workers (``test_sglang_pd_group_behind_the_real_router``).
  Workers answer ``GET /health`` (``http_server.py``), which the real router checks first.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from standin_openai import (
    Deployment,
    Script,
    Traffic,
    answer_limit,
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

VERSION = "0.5.23"
CHAT_TOKENIZE_FROM = (0, 5, 12)


@dataclass
class SGLangWorker:
    """Knobs of one SGLang worker; read per request."""

    model: str = "qwen/qwen2.5-0.5b-instruct"
    context_len: int = 32768
    rank_pools: list[int] = field(default_factory=lambda: [20480])  # one per DP rank
    page_size: int = 1
    mode: str = "null"  # disaggregation_mode: null | prefill | decode
    version: str = VERSION
    legacy: bool = False  # 0.5.5: /get_server_info only
    hicache_storage_backend: str | None = None
    status: int = 200  # != 200: every route answers this (a sick worker)
    refuse: str | None = None  # completions answer SGLang's 400 with this message
    is_embedding: bool = False  # --is-embedding: an embedding model (server args)
    dimensions: int = 8
    script: Script = field(default_factory=Script)
    traffic: Traffic = field(default_factory=Traffic)

    def server_info(self) -> dict[str, Any]:
        args = {
            "model_path": self.model,
            "served_model_name": self.model,
            "context_length": None,
            "page_size": self.page_size,
            "max_total_tokens": None,
            "dp_size": len(self.rank_pools),
            "disaggregation_mode": self.mode,
            "hicache_storage_backend": self.hicache_storage_backend,
            "enable_lmcache": False,
            "is_embedding": self.is_embedding,
        }
        states = [
            {
                **args,
                "last_gen_throughput": 0.0,
                "memory_usage": {
                    "weight": 0.98,
                    "kvcache": 0.23,
                    "startup_available": 60.0,
                    "token_capacity": pool,
                    "token_capacity_swa": None,
                    "graph": {"decode": 0.0},
                },
                "effective_max_running_requests_per_dp": 128,
            }
            for pool in self.rank_pools
        ]
        return {
            **args,
            "status": "ready",
            "max_total_num_tokens": self.rank_pools[0],  # the handshake keeps rank 0's
            "max_req_input_len": self.rank_pools[0] - 6,
            "internal_states": states,
            "version": self.version,
        }


NOT_EMBEDDING = (
    "This model does not appear to be an embedding model by default. Please add `--is-embedding` "
    "when launching the server or try another model."
)


def _error(status: int, message: str, type_: str = "BadRequestError") -> JSONResponse:
    body = {"object": "error", "message": message, "type": type_, "param": None}
    return JSONResponse({**body, "code": status}, status_code=status)


def _counts_chats(version: str) -> bool:
    return tuple(int(part) for part in version.split(".")[:3]) >= CHAT_TOKENIZE_FROM


def chat_tokens(body: dict[str, Any]) -> int:
    """The prompt the chat route renders (``serving_chat.py``): the tools unless ``tool_choice`` is
    "none", only the named one when it names one."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice == "none":
        tools = None
    elif isinstance(choice, dict) and tools:
        name = choice.get("function", {}).get("name")
        tools = [t for t in tools if t.get("function", {}).get("name") == name] or None
    return word_count(body.get("prompt"), body.get("messages"), tools=tools)


def worker_app(w: SGLangWorker) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        w.traffic.paths.append(request.url.path)
        w.traffic.headers.append({k.lower(): v for k, v in request.headers.items()})
        if w.status != 200:
            return JSONResponse({"detail": "sick"}, status_code=w.status)
        response: Response = await call_next(request)
        return response

    @app.get("/health")
    async def health() -> Any:  # http_server.py: what the model gateway checks before routing
        return Response(status_code=200)

    @app.get("/server_info")
    async def server_info() -> Any:
        if w.legacy:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return w.server_info()

    @app.get("/get_server_info")
    async def get_server_info() -> Any:
        return w.server_info()

    @app.get("/model_info")
    async def model_info() -> Any:
        return {"model_path": w.model, "is_generation": True, "disaggregation_mode": w.mode}

    @app.get("/v1/models")
    async def models() -> Any:
        card = {"id": w.model, "object": "model", "owned_by": "sglang", "root": w.model}
        return {
            "object": "list",
            "data": [{**card, "parent": None, "max_model_len": w.context_len}],
        }

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        body = await request.json()
        w.traffic.tokenize_bodies.append(body)
        if not _counts_chats(w.version) and not isinstance(body.get("prompt"), str | list):
            message = "1 validation error for TokenizeRequest\nprompt\n  Field required"
            return _error(400, message, "Bad Request")  # messages: an extra field, ignored
        count = chat_tokens(body)  # messages: rendered as for a chat completion of this body
        return {"tokens": list(range(count)), "count": count, "max_model_len": w.context_len}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
        body = await request.json()
        w.traffic.bodies.append(body)
        if not w.is_embedding:
            return _error(400, NOT_EMBEDDING)
        data, tokens = embedding_data(body, w.dimensions)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
        return {
            "data": data,
            "model": w.model,
            "object": "list",
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
        tokens = chat_tokens(body)
        if tokens + answer_limit(body) > min(w.context_len, *w.rank_pools):
            return _error(400, f"The input ({tokens} tokens) is longer than the model's context")
        words = answer_words(body, w.script, w.traffic)
        if body.get("stream"):
            objs = chunks(body, words, tokens, w.script, model=w.model)
            return StreamingResponse(sse(objs), media_type="text/event-stream")
        return full_body(body, words, tokens, w.script, model=w.model)

    return app


@dataclass
class PDRouter:
    """A router over SGLang workers: ``mini_lb`` or the model gateway (``flavor``), over PD
    workers (prefill and decode) or, the model gateway only, regular ones."""

    prefill: list[str]
    decode: list[str]
    regular: list[str] = field(default_factory=list)
    flavor: str = "model_gateway"  # or "mini_lb"
    traffic: Traffic = field(default_factory=Traffic)

    def __post_init__(self) -> None:
        self._pairs = itertools.cycle(
            [(p, d) for p in self.prefill for d in self.decode] or [("", "")]
        )
        self._regular = itertools.cycle(self.regular or [""])

    @property
    def first(self) -> str:
        """The worker the model gateway proxies ``/get_server_info`` and ``/v1/models`` to."""
        return (self.prefill or self.regular)[0]

    def add(self, url: str, role: str) -> None:
        """A worker registered with the running router (the model gateway's POST /workers)."""
        (self.prefill if role == "prefill" else self.decode).append(url)
        self.__post_init__()

    def worker_list(self) -> dict[str, Any]:
        listed = [(u, "prefill") for u in self.prefill] + [(u, "decode") for u in self.decode]
        listed += [(u, "regular") for u in self.regular]
        workers = [
            {
                "id": f"worker-{i}",
                "url": url,
                "worker_type": role,
                "connection_mode": "http",
                "runtime_type": "sglang",
                "priority": 50,
                "cost": 1.0,
                **({"bootstrap_port": 8998} if role == "prefill" else {}),
                "is_healthy": True,
                "status": "ready",
                "load": 0,
                "job_status": None,
            }
            for i, (url, role) in enumerate(listed)
        ]
        by_type = {"regular": len(self.regular), "prefill": len(self.prefill)}
        by_type["decode"] = len(self.decode)
        stats = {"total_workers": len(workers), "healthy_workers": len(workers)}
        stats |= {"total_models": 1, "total_load": 0, "by_type": by_type}
        return {"workers": workers, "total": len(workers), "stats": stats}


def router_app(r: PDRouter) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=30)

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        r.traffic.paths.append(request.url.path)
        response: Response = await call_next(request)
        return response

    @app.get("/get_server_info")
    async def get_server_info() -> Any:
        if r.flavor == "model_gateway":
            return (await client.get(f"{r.first}/get_server_info")).json()
        prefill = [(await client.get(f"{u}/get_server_info")).json() for u in r.prefill]
        decode = [(await client.get(f"{u}/get_server_info")).json() for u in r.decode]
        states = [s for info in decode for s in info.get("internal_states", [])]
        return {"internal_states": states, "prefill": prefill, "decode": decode}

    @app.get("/v1/models")
    async def models() -> Any:
        return (await client.get(f"{r.first}/v1/models")).json()

    if r.flavor == "model_gateway":

        @app.get("/workers")
        async def workers() -> Any:
            return r.worker_list()

        @app.post("/v1/tokenize")
        async def tokenize(request: Request) -> Any:
            body = await request.json()
            if not isinstance(body.get("prompt"), str | list):  # serde: prompt is required
                return JSONResponse({"error": "missing field `prompt`"}, status_code=422)
            count = word_count(body["prompt"] if isinstance(body["prompt"], str) else "")
            return {"tokens": list(range(count)), "count": count, "char_count": 0}

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def complete(request: Request) -> Any:
        body = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower().startswith("x-")}
        path = request.url.path
        if r.regular:
            decode, sent = next(r._regular), body  # one worker answers the whole request
        else:
            prefill, decode = next(r._pairs)
            sent = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_room": 7}
            await client.post(f"{prefill}{path}", json={**sent, "stream": False}, headers=headers)
        if not body.get("stream"):
            answer = await client.post(f"{decode}{path}", json=sent, headers=headers)
            return JSONResponse(answer.json(), status_code=answer.status_code)
        upstream = client.build_request("POST", f"{decode}{path}", json=sent, headers=headers)
        opened = await client.send(upstream, stream=True)
        if opened.status_code != 200:
            await opened.aread()
            return JSONResponse(opened.json(), status_code=opened.status_code)
        return StreamingResponse(opened.aiter_raw(), media_type="text/event-stream")

    return app


@dataclass
class SGLangPD(Deployment):
    """A running PD deployment: the router and its workers."""

    router: PDRouter = field(kw_only=True)
    workers: dict[str, SGLangWorker] = field(kw_only=True)


async def start_sglang_pd(
    workers: dict[str, SGLangWorker], *, flavor: str = "model_gateway"
) -> SGLangPD:
    """The workers behind one router; workers whose ``mode`` is "null" are regular ones (the
    members an operator lists for them are "unified")."""
    servers, urls = await serve_workers({name: worker_app(w) for name, w in workers.items()})
    roles = {n: "unified" if w.mode == "null" else w.mode for n, w in workers.items()}
    router = PDRouter(
        prefill=[urls[n] for n, role in roles.items() if role == "prefill"],
        decode=[urls[n] for n, role in roles.items() if role == "decode"],
        regular=[urls[n] for n, role in roles.items() if role == "unified"],
        flavor=flavor,
    )
    router_server = await serve(router_app(router))
    return SGLangPD(router_server, urls, roles, servers, router=router, workers=workers)
