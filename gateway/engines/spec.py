"""The engine domain: what kind of engine sits behind the gateway and how it is reached.

An ``EngineSpec`` is one upstream engine as configured (the settings' ``engines``, an engines file,
``--engine`` or the admin API); ``EngineKind`` says how it is introspected and called, and a group
behind a router lists its ``MemberSpec`` workers. Pure: pydantic models and parsing, no I/O but
reading an engines file when asked.
"""

from __future__ import annotations

import json
import os
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Self
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from contracts.settings import settings_error


class EngineKind(StrEnum):
    """How an engine is introspected (and, by default, how it is called)."""

    BUNDLED = "bundled"  # kvguard's own backend: GET /engine/capacity
    SGLANG = "sglang"  # GET /server_info (+ /get_server_info on old releases) + /v1/models
    VLLM = "vllm"  # GET /v1/models + /metrics vllm:cache_config_info + /version
    OPENAI = "openai"  # any OpenAI-compatible server: capacity declared, not measured
    LITELLM = "litellm"  # any provider litellm supports: capacity declared, not measured


class UpstreamPath(StrEnum):
    DIRECT = "direct"  # httpx straight to the engine's OpenAI-compatible routes
    LITELLM = "litellm"  # litellm.acompletion (providers that need translation)


INTROSPECTED_KINDS = frozenset({EngineKind.BUNDLED, EngineKind.SGLANG, EngineKind.VLLM})
GROUP_KINDS = frozenset({EngineKind.SGLANG, EngineKind.VLLM})
SECRET_REF = r"^[A-Z_][A-Z0-9_]{0,127}$"


class MemberRole(StrEnum):
    """Where a request can land inside a deployment behind a router."""

    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"  # a non-disaggregated replica (a router over plain workers)


class MemberSpec(BaseModel):
    """One worker of an engine group: introspected directly, never sent traffic by the gateway."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    role: MemberRole
    url: Annotated[str, Field(min_length=1, max_length=512)]
    api_key_env: str | None = Field(default=None, pattern=SECRET_REF)
    declared_pool_tokens: int | None = Field(
        default=None,
        gt=0,
        description="vLLM without stats: the KV pool the operator provisioned; accepted only "
        "when it is at least the worker's max_model_len (vLLM refuses to start otherwise)",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return check_http_url(value)

    def key(self) -> str | None:
        return resolve_secret_ref(self.api_key_env)


def check_http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("an engine URL must be http(s) with a host")
    return value.rstrip("/")


def resolve_secret_ref(name: str | None) -> str | None:
    """The value of a secret reference (an environment variable of the gateway), read at use.

    Read per call rather than once so a rotated secret applies without a restart; a reference
    that is not set resolves to None (the engine is then called without a key).
    """
    if name is None:
        return None
    return os.environ.get(name) or None


class EngineSpec(BaseModel):
    """One upstream engine as configured (file, ``--engine``, env or the admin API)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=64,
            pattern=r"^[A-Za-z0-9_.:-]+$",
            description="unique name of the engine (metrics, audit rows, quarantine)",
        ),
    ]
    kind: EngineKind = Field(
        default=EngineKind.BUNDLED,
        description="how it is introspected and called: bundled, sglang, vllm, openai, litellm",
    )
    base_url: Annotated[
        str,
        Field(
            min_length=1, max_length=512, description="the engine's (or its router's) http(s) URL"
        ),
    ]
    model: str | None = Field(
        default=None,
        max_length=256,
        description="introspected kinds: the model the engine must report (else refused); "
        "declared kinds: the model name tenants use",
    )
    litellm_model: str | None = Field(
        default=None,
        max_length=256,
        description="litellm engines: the provider/model litellm calls (e.g. openai/gpt-4o-mini)",
    )
    declared_max_model_len: int | None = Field(
        default=None,
        gt=0,
        description=(
            "declared kinds (openai, litellm): the context window the provider promises (nothing"
            " can be measured)"
        ),
    )
    allow_unverified: bool = Field(
        default=False,
        description="route to a declared-capacity engine although nothing was measured",
    )
    upstream: UpstreamPath | None = Field(
        default=None,
        description=(
            "how completions are sent: direct (the engine's OpenAI routes) or litellm; default: "
            "litellm for litellm engines, else direct"
        ),
    )
    api_key: SecretStr | None = Field(
        default=None,
        description=(
            "the credential presented to this engine (a provider's key; bundled engines: default"
            " KVGUARD_ENGINE_TOKEN)"
        ),
    )
    api_key_env: str | None = Field(
        default=None,
        pattern=SECRET_REF,
        description="a secret reference: the gateway environment variable holding the engine's "
        "key (the only form the admin API accepts; the key itself is never stored)",
    )
    members: tuple[MemberSpec, ...] = Field(
        default=(),
        max_length=256,
        description="an SGLang/vLLM deployment behind a router: base_url is the router (traffic), "
        "every member is introspected and the smallest pool of all of them is enforced",
    )
    declared_pool_tokens: int | None = Field(
        default=None, gt=0, description="vLLM without stats: see MemberSpec.declared_pool_tokens"
    )
    discover_members: bool = Field(
        default=False,
        description="sglang/vllm behind a router: also read the router's own worker list each "
        "poll (SGLang model gateway GET /workers, vLLM PD proxy GET /status); a listed worker "
        "that is not a member fails the engine closed; with no members, the list is the members",
    )
    send_kvguard_headers: bool | None = Field(
        default=None,
        description="send the tenant id, request id and trace headers upstream; default: yes for "
        "bundled/SGLang/vLLM (inside the deployment), no for openai/litellm (third parties)",
    )
    api_base: bool = Field(
        default=True,
        description="litellm: pass base_url as api_base (false: the provider's own endpoint, "
        "e.g. region- or project-configured providers; base_url is then only a label)",
    )

    @field_validator("base_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return check_http_url(value)

    @model_validator(mode="after")
    def _check_kind_fields(self) -> Self:
        declared = self.model is not None and self.declared_max_model_len is not None
        if self.kind not in INTROSPECTED_KINDS and not declared:
            raise ValueError(f"a {self.kind.value} engine needs model and declared_max_model_len")
        if self.kind is EngineKind.LITELLM and self.litellm_model is None:
            raise ValueError("a litellm engine needs litellm_model (e.g. 'openai/<model>')")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("give api_key or api_key_env, not both")
        if (self.members or self.discover_members) and self.kind not in GROUP_KINDS:
            raise ValueError("members are for sglang and vllm deployments behind a router")
        names = [member.name for member in self.members]
        if len(set(names)) != len(names):
            raise ValueError("member names must be unique within an engine")
        if self.members and not any(m.role is not MemberRole.DECODE for m in self.members):
            raise ValueError("a group needs a prefill or unified member (it counts tokens)")
        return self

    def key(self) -> str | None:
        """The engine's own credential (a literal from the config, or a secret reference)."""
        if self.api_key is not None:
            return self.api_key.get_secret_value() or None
        return resolve_secret_ref(self.api_key_env)

    @property
    def sends_kvguard_headers(self) -> bool:
        if self.send_kvguard_headers is not None:
            return self.send_kvguard_headers
        return self.kind in INTROSPECTED_KINDS

    @property
    def introspected(self) -> bool:
        return self.kind in INTROSPECTED_KINDS

    @property
    def upstream_path(self) -> UpstreamPath:
        if self.upstream is not None:
            return self.upstream
        return UpstreamPath.LITELLM if self.kind is EngineKind.LITELLM else UpstreamPath.DIRECT


def with_engine_credential(spec: EngineSpec, token: SecretStr | None) -> EngineSpec:
    """``spec`` presenting the deployment's engine credential: a bundled engine without an
    ``api_key`` of its own gets ``token`` (``backend.server.auth``)."""
    if token is None or spec.kind is not EngineKind.BUNDLED or spec.api_key is not None:
        return spec
    return spec.model_copy(update={"api_key": token})


def parse_engine_arg(arg: str) -> EngineSpec:
    """``--engine URL`` (bundled) or ``--engine KIND=URL``; the name is the URL's host:port."""
    kind = EngineKind.BUNDLED
    url = arg
    head, sep, tail = arg.partition("=")
    if sep and "://" not in head:
        kind, url = EngineKind(head), tail
    netloc = urlsplit(url).netloc or url
    return EngineSpec(name=netloc, kind=kind, base_url=url)


def load_engines_file(path: Path) -> list[EngineSpec]:
    """A TOML (``[[engines]]`` tables) or JSON (``{"engines": [...]}``) engines file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
        raise ValueError(f"engines file {path}: cannot read it ({reason})") from exc
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except ValueError as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ValueError(f"engines file {path}: {exc}") from exc
    if not isinstance(data, dict) or set(data) - {"engines"}:
        raise ValueError(f"{path}: only an 'engines' list is allowed at the top level")
    try:
        return [EngineSpec.model_validate(item) for item in data.get("engines", [])]
    except ValidationError as exc:
        raise ValueError(f"engines file {path}: {settings_error(exc)}") from exc
