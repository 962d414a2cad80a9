"""SGLang: ``GET /server_info`` for the real pool, ``GET /v1/models`` for the window.

Checked against SGLang's own sources (the released wheels): 0.5.5 (``/get_server_info`` only),
0.5.9, 0.5.10, 0.5.12, 0.5.14 and 0.5.23 (``/server_info``; ``/get_server_info`` logs a
deprecation warning on every call, so it is asked only when ``/server_info`` is a 404).

``/server_info`` publishes the resolved server arguments at the top level (``page_size``,
``served_model_name``, ``context_length``, ``disaggregation_mode``, ``hicache_storage_backend``,
``enable_lmcache``), the scheduler's handshake (``max_total_num_tokens``: the KV pool in tokens,
``max_req_input_len``: the longest prompt; with data parallelism these are rank 0's only) and
``internal_states``: one entry per DP rank (``Scheduler.get_internal_state``) whose pool is
``memory_usage.token_capacity``. The smallest pool of any rank is the pool. ``/v1/models``
reports the effective ``max_model_len``.

Behind the Python ``mini_lb`` (sglang-router 0.3.2) ``/get_server_info`` answers
``{"prefill": [info...], "decode": [info...], "internal_states": [...]}``: every worker's own
info, each read as a role. Behind the SGLang model gateway (SMG 1.9.0), ``/get_server_info`` is
the first prefill worker's only; a standalone engine that reports a disaggregation mode is
therefore refused with the instruction to register the deployment as a group.

Prefix-cache isolation: ``cache_salt`` on chat/completion requests namespaces the radix cache
(0.5.5-0.5.14: joined into ``extra_key``; 0.5.23: its own radix-key field). Upstream fixed salts
not reaching the scheduler in April 2026 (sgl-project/sglang#23300), so isolation is reported
from 0.5.12, the first release checked after the fix; never with a hierarchical-cache storage
backend or LMCache, whose external keys are token-only (SGLang's radix-key contract); never for a
group behind the model gateway, which drops ``cache_salt`` from what it sends the workers (the
real sglang-router 0.3.2, run by the tests; ``router_drops_salt``). mini_lb passes it on.
"""

from __future__ import annotations

from typing import Any

import httpx

from gateway.engines import prompt
from gateway.engines.adapters.base import (
    AdapterError,
    get_json,
    optional_positive_int,
    parse_version,
    positive_int,
)
from gateway.engines.adapters.group import GroupAdapter, Worker
from gateway.engines.capacity import CacheIsolation, CapacitySnapshot, RoleView
from gateway.engines.spec import MemberRole

SERVER_INFO = "/server_info"
LEGACY_SERVER_INFO = "/get_server_info"
SALT_FROM = (0, 5, 12)
CHAT_TOKENIZE_FROM = (0, 5, 12)  # TokenizeRequest takes messages (before: a required prompt)
PD_MODES = ("prefill", "decode")


class SGLangAdapter(GroupAdapter):
    tokenize_paths = ("/v1/tokenize", "/tokenize")

    def tokenize_request(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        return prompt.for_sglang(model, body)

    async def listed_workers(
        self, client: httpx.AsyncClient, *, timeout: float
    ) -> list[tuple[str, MemberRole]]:
        """The SGLang model gateway's ``GET /workers`` (``WorkerListResponse``, admin auth)."""
        data = await get_json(client, self.url("/workers"), timeout=timeout, headers=self.headers())
        return listed_roles(data.get("workers"), url_key="url", role_key="worker_type")

    async def read_worker(
        self, client: httpx.AsyncClient, worker: Worker, *, timeout: float
    ) -> CapacitySnapshot:
        info = await _server_info(client, worker, timeout=timeout)
        models = await get_json(
            client, f"{worker.url}/v1/models", timeout=timeout, headers=worker.headers
        )
        return snapshot_from_sglang(info, models)

    async def router_drops_salt(self, client: httpx.AsyncClient, *, timeout: float) -> str | None:
        """The model gateway (it lists its workers) rebuilds every request from its own schema:
        ``cache_salt`` never reaches the workers (sglang-router 0.3.2, tested with the real
        router). mini_lb passes the request on as it came."""
        try:
            await self.listed_workers(client, timeout=timeout)
        except AdapterError:
            return None
        return (
            "the SGLang model gateway in front of the members drops cache_salt from every "
            "request (sglang-router 0.3.2): tenants share the workers' radix caches unless the "
            "workers run with --disable-radix-cache; route through mini_lb to salt them"
        )

    async def router_problem(self, client: httpx.AsyncClient, *, timeout: float) -> str | None:
        """The model gateway lists its workers (``GET /workers``); a worker has no such list."""
        try:
            listed = await self.listed_workers(client, timeout=timeout)
        except AdapterError:
            return None  # no worker list: not the model gateway (mini_lb is caught by its info)
        roles = sorted({role.value for _, role in listed})
        pd = set(roles) & set(PD_MODES)
        return (
            f"this URL is a router (GET /workers lists {len(listed)} workers: {', '.join(roles)}; "
            "it shows its first worker's info only and counts no chat): register the deployment "
            f"as a group, listing every {'prefill and decode ' if pd else ''}worker as members "
            "with the router as base_url, or set discover_members = true"
        )

    def chat_refusal(self, snapshot: CapacitySnapshot) -> str | None:
        parsed = parse_version(snapshot.version)
        if parsed is None or parsed >= CHAT_TOKENIZE_FROM:
            return None  # an unknown release is probed with a chat: it fails closed if it cannot
        return (
            f"SGLang {snapshot.version} counts prompt strings only on its tokenize route (chat "
            f"messages from {'.'.join(map(str, CHAT_TOKENIZE_FROM))}): upgrade SGLang to serve "
            "chats through the gateway; completions are counted"
        )

    def standalone_problem(self, snapshot: CapacitySnapshot) -> str | None:
        modes = sorted({role.role for role in snapshot.roles if role.role in PD_MODES})
        if modes and set(modes) != set(PD_MODES):
            return (
                f"this URL reports a {'/'.join(modes)} worker only (a PD router shows one "
                "worker's info): register the deployment as a group listing every prefill and "
                "decode worker as members, with the router as base_url"
            )
        return None


def listed_roles(entries: Any, *, url_key: str, role_key: str) -> list[tuple[str, MemberRole]]:
    if not isinstance(entries, list):
        raise AdapterError("router worker list: not a list")
    listed = []
    roles = {role.value for role in MemberRole}
    for entry in entries:
        fields = entry if isinstance(entry, dict) else {}
        url, raw = fields.get(url_key), str(fields.get(role_key))
        role = "unified" if raw == "regular" else raw  # the model gateway's non-PD workers
        if not isinstance(url, str) or role not in roles:
            raise AdapterError(f"router worker list: an entry without a url or a known {role_key}")
        listed.append((url, MemberRole(role)))
    return listed


async def _server_info(
    client: httpx.AsyncClient, worker: Worker, *, timeout: float
) -> dict[str, Any]:
    try:
        return await get_json(
            client, f"{worker.url}{SERVER_INFO}", timeout=timeout, headers=worker.headers
        )
    except AdapterError as exc:
        if "HTTP 404" not in str(exc):
            raise
    return await get_json(
        client, f"{worker.url}{LEGACY_SERVER_INFO}", timeout=timeout, headers=worker.headers
    )


def snapshot_from_sglang(info: dict[str, Any], models: dict[str, Any]) -> CapacitySnapshot:
    """One worker's info, or a mini_lb answer (every prefill and decode worker's info)."""
    workers = _router_workers(info)
    roles = [_role(part, where=f"sglang {name}") for name, part in workers]
    card = _model_card(models, _first(workers, "served_model_name"))
    window = optional_positive_int(card, "max_model_len") or _first_int(workers, "context_length")
    if window is None:
        raise AdapterError("sglang: no context_length and no max_model_len in /v1/models")
    prompt_limits = [
        limit for _, part in workers for limit in _prompt_limits(part) if limit is not None
    ]
    version = _first(workers, "version")
    return CapacitySnapshot(
        model=str(card["id"]),
        context_window=window,
        roles=tuple(roles),
        measured=True,
        max_prompt_tokens=min(prompt_limits) if prompt_limits else None,
        isolation=isolation(version, [part for _, part in workers]),
        version=version if isinstance(version, str) else None,
    )


def _router_workers(info: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    listed = {mode: info.get(mode) for mode in PD_MODES}
    if not any(isinstance(value, list) for value in listed.values()):
        return [("server_info", info)]
    workers: list[tuple[str, dict[str, Any]]] = []
    for mode, parts in listed.items():
        for index, part in enumerate(parts if isinstance(parts, list) else []):
            if not isinstance(part, dict):
                raise AdapterError(f"sglang router: {mode}[{index}] is not an object")
            workers.append((f"{mode}[{index}]", {**part, "disaggregation_mode": mode}))
    if not workers or {part["disaggregation_mode"] for _, part in workers} != set(PD_MODES):
        raise AdapterError("sglang router: its info lists no prefill or no decode worker")
    return workers


def _role(info: dict[str, Any], *, where: str) -> RoleView:
    """Every DP rank's pool; the smallest is this worker's pool."""
    pools = [positive_int(info, "max_total_num_tokens", where=where)]
    for index, state in enumerate(info.get("internal_states") or []):
        if not isinstance(state, dict):
            continue
        usage = state.get("memory_usage")
        rank_pool = (
            optional_positive_int(usage, "token_capacity") if isinstance(usage, dict) else None
        )
        rank_pool = rank_pool or optional_positive_int(state, "max_total_num_tokens")
        if rank_pool is None and "memory_usage" in state:
            raise AdapterError(f"{where}: internal_states[{index}] has no token_capacity")
        if rank_pool is not None:
            pools.append(rank_pool)
    mode = info.get("disaggregation_mode")
    return RoleView(
        role=mode if mode in PD_MODES else "unified",
        pool_tokens=min(pools),
        page_size=optional_positive_int(info, "page_size"),
    )


def _prompt_limits(info: dict[str, Any]) -> list[int | None]:
    limits = [optional_positive_int(info, "max_req_input_len")]
    for state in info.get("internal_states") or []:
        if isinstance(state, dict):
            limits.append(optional_positive_int(state, "max_req_input_len"))
    return limits


def isolation(version: Any, infos: list[dict[str, Any]]) -> CacheIsolation:
    parsed = parse_version(version)
    if parsed is None or parsed < SALT_FROM:
        return CacheIsolation(
            field=None,
            detail=f"SGLang {version or 'of unknown version'}: cache_salt is honoured from "
            f"{'.'.join(map(str, SALT_FROM))} (upgrade to isolate tenants' prefix caches)",
        )
    for info in infos:
        if info.get("hicache_storage_backend") or info.get("enable_lmcache"):
            return CacheIsolation(
                field=None,
                detail="hierarchical-cache storage / LMCache keys are token-only in SGLang: "
                "cache_salt does not reach them (disable them to isolate tenants)",
            )
    return CacheIsolation(field="cache_salt", detail=f"SGLang {version}: radix cache salted")


def _model_card(models: dict[str, Any], served: Any) -> dict[str, Any]:
    cards = [card for card in models.get("data") or [] if isinstance(card, dict) and "id" in card]
    if not cards:
        raise AdapterError("sglang /v1/models lists no model")
    for card in cards:
        if card["id"] == served:
            return card
    base = [card for card in cards if not card.get("parent")]  # LoRA adapters have a parent
    return (base or cards)[0]


def _first(workers: list[tuple[str, dict[str, Any]]], key: str) -> Any:
    return next((part[key] for _, part in workers if part.get(key) is not None), None)


def _first_int(workers: list[tuple[str, dict[str, Any]]], key: str) -> int | None:
    values = [optional_positive_int(part, key) for _, part in workers]
    known = [value for value in values if value is not None]
    return min(known) if known else None
