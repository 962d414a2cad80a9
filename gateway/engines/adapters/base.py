"""The adapter contract: read an engine's capacity, count a prompt's tokens exactly.

One adapter per engine kind (bundled, SGLang, vLLM, declared OpenAI/litellm). ``introspect``
returns a ``CapacitySnapshot`` or raises ``AdapterError`` with a short reason (never a payload
echo). ``count_tokens`` asks the engine's own tokenizer at the target the last introspection found
(``snapshot.tokenize``: the path the engine really serves, ``/v1/tokenize`` or ``/tokenize``, on
the engine or on one member of its group; the answer shape is shared: ``{"count": N, ...}``),
sent what the kind needs to render the prompt as its chat route will (``tokenize_request``, from
``gateway.engines.prompt``: the tools too), so the count matches what the engine will admit;
declared engines count locally instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import httpx

from gateway.engines import prompt
from gateway.engines.capacity import CapacitySnapshot, TokenizeTarget
from gateway.engines.spec import EngineSpec

MAX_INTROSPECTION_BYTES = 4 << 20
DEFAULT_TOKENIZE_PATH = "/tokenize"


class AdapterError(RuntimeError):
    """The engine could not be introspected or could not count tokens; the message says why."""


class EngineAdapter(ABC):
    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec

    @abstractmethod
    async def introspect(self, client: httpx.AsyncClient, *, timeout: float) -> CapacitySnapshot:
        """Read the engine's real capacity now."""

    async def count_tokens(
        self,
        client: httpx.AsyncClient,
        *,
        model: str,
        body: dict[str, Any],
        timeout: float,
        snapshot: CapacitySnapshot | None = None,
    ) -> int:
        """Exact prompt tokens of ``body`` (the chat or completion request the engine will get),
        rendered by the engine's own tokenizer and chat template."""
        target = snapshot.tokenize if snapshot is not None else None
        if target is None:
            target = TokenizeTarget(url=self.url(DEFAULT_TOKENIZE_PATH))
        if "messages" in body and target.chat_refused is not None:
            raise AdapterError(target.chat_refused)
        headers = self.headers(member=target.member)
        request = self.tokenize_request(model, body)
        data = await post_json(client, target.url, request, timeout=timeout, headers=headers)
        return _count(data)

    def tokenize_request(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        """What this kind's tokenize route must be sent to render ``body``'s prompt as its chat
        route will (``gateway.engines.prompt``): here the messages or the prompt."""
        return prompt.plain(model, body)

    def headers(self, *, member: str | None = None) -> dict[str, str]:
        """Credentials for the engine (or one member of its group), never the tenant's key."""
        key = self.spec.key()  # also a discovered worker's: it sits behind the same router
        found = [m for m in self.spec.members if m.name == member]
        if found:
            key = found[0].key()
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    def url(self, path: str) -> str:
        return f"{self.spec.base_url}{path}"

    def check_model(self, reported: str) -> str:
        if self.spec.model is not None and reported != self.spec.model:
            raise AdapterError(
                f"engine serves model '{reported}', configured as '{self.spec.model}'"
            )
        return reported


def _count(data: dict[str, Any]) -> int:
    count = data.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise AdapterError("tokenize answer has no valid 'count'")
    return count


async def probe_tokenize(
    client: httpx.AsyncClient,
    base: str,
    paths: tuple[str, ...],
    *,
    request: dict[str, Any],
    timeout: float,
    headers: dict[str, str],
) -> str:
    """The first of ``paths`` on ``base`` that counts ``request`` (404/405: not served, try the
    next); any other refusal fails the probe.

    Routers differ from their workers here (the SGLang model gateway routes only /v1/tokenize,
    and counts prompt strings only; vLLM serves only /tokenize), so the path is found by asking
    with what admission will send, not assumed per kind.
    """
    tried = []
    for path in paths:
        url = f"{base}{path}"
        try:
            _count(await post_json(client, url, request, timeout=timeout, headers=headers))
            return url
        except AdapterError as exc:
            if not ("HTTP 404" in str(exc) or "HTTP 405" in str(exc)):
                raise
            tried.append(path)
    raise AdapterError(f"no tokenize endpoint on {base} (tried {', '.join(tried)})")


async def get_response(
    client: httpx.AsyncClient, url: str, *, timeout: float, headers: dict[str, str] | None = None
) -> httpx.Response:
    try:
        response = await client.get(url, timeout=timeout, headers=headers or {})
    except httpx.HTTPError as exc:
        raise AdapterError(f"GET {httpx.URL(url).path}: {exc.__class__.__name__}") from exc
    if response.status_code != 200:
        raise AdapterError(f"GET {httpx.URL(url).path}: HTTP {response.status_code}")
    if len(response.content) > MAX_INTROSPECTION_BYTES:
        raise AdapterError(f"GET {httpx.URL(url).path}: answer too large")
    return response


async def get_json(
    client: httpx.AsyncClient, url: str, *, timeout: float, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    response = await get_response(client, url, timeout=timeout, headers=headers)
    return _json_object(response, f"GET {httpx.URL(url).path}")


async def post_json(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    what = f"POST {httpx.URL(url).path}"
    try:
        response = await client.post(url, json=body, timeout=timeout, headers=headers or {})
    except httpx.HTTPError as exc:
        raise AdapterError(f"{what}: {exc.__class__.__name__}") from exc
    if response.status_code != 200:
        raise AdapterError(f"{what}: HTTP {response.status_code}")
    return _json_object(response, what)


def _json_object(response: httpx.Response, what: str) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError as exc:
        raise AdapterError(f"{what}: answer is not JSON") from exc
    if not isinstance(data, dict):
        raise AdapterError(f"{what}: answer is not a JSON object")
    return data


def positive_int(data: dict[str, Any], key: str, *, where: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AdapterError(f"{where}: '{key}' missing or not a positive integer")
    return value


def optional_positive_int(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def parse_version(version: Any) -> tuple[int, ...] | None:
    if not isinstance(version, str):
        return None
    numbers = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers) if numbers else None
