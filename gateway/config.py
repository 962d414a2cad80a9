"""The gateway's one settings class (the engines it reads are ``gateway.engines.spec``).

Built in ``main()``/lifespan (never at import) from ``KVGUARD_*`` environment variables, an
optional engines file and command-line overrides. Unknown fields are refused so a typo fails at
load; default secrets are refused outside development; production requires Redis.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
from pathlib import Path
from typing import Self

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from contracts.settings import (
    DEV_ADMIN_TOKEN,
    KvguardSettings,
    RunMode,
    require_distinct_secrets,
    require_real_secret,
    require_strong_if_set,
)
from gateway.engines.spec import EngineSpec, load_engines_file, with_engine_credential

MiB = 1 << 20
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class GatewaySettings(KvguardSettings):
    """Everything the gateway (and ``kvguard admin``) reads from ``KVGUARD_*``."""

    host: str = Field(default="127.0.0.1", description="address the gateway listens on")
    port: int = Field(default=8000, ge=0, le=65535, description="port the gateway listens on")
    data_dir: Path = Field(
        default=Path("data"),
        description=(
            "where the embedded SQLite database (kvguard.db) and the local spool live; relative "
            "paths are from the working directory"
        ),
    )
    database_url: str | None = Field(
        default=None,
        description=(
            "SQLAlchemy URL of the database (postgresql+psycopg://... in production; each replica "
            "holds up to 25 connections: its pool's, 5 kept and 10 more under load, and ten of "
            "its own, the key renewal's, the audit writer's and eight for key lookups (four for "
            "each lane of the auth cache, connected at start)); unset: SQLite at "
            "KVGUARD_DATA_DIR/kvguard.db"
        ),
    )
    redis_url: str | None = Field(
        default=None,
        description=(
            "Redis for tenant limits and quarantine state shared by every replica (required in "
            "production); unset: in-process"
        ),
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description=(
            "bearer credential of the admin API (required in production; development: the well-"
            "known dev token)"
        ),
    )
    metrics_token: SecretStr | None = Field(
        default=None,
        description="bearer credential for GET /metrics (it carries every tenant's series; the "
        "admin token is accepted too); required outside development, where unset means open",
    )
    engine_token: SecretStr | None = Field(
        default=None,
        description="the deployment's engine credential, presented to every bundled engine "
        "without an api_key of its own (the engines' KVGUARD_ENGINE_TOKEN); required in "
        "production",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="addresses or networks (CIDR) of the reverse proxies in front of the gateway "
        "(JSON list): only from these are X-Forwarded-For, Forwarded and X-Real-IP believed when "
        "the gateway decides who a client is (the failed-credential throttles); default: none, "
        "every decision keys on the TCP peer",
    )
    auth_failures_per_minute: int = Field(
        default=30,
        gt=0,
        le=1_000_000,
        description="unknown, malformed, revoked or expired tenant keys an address may send per "
        "minute (per replica); beyond that its keys are refused with 429 before any database "
        "lookup (a key this replica already verified still works)",
    )
    operator_failures_per_minute: int = Field(
        default=10,
        gt=0,
        description="wrong admin or metrics tokens an address may send per minute (per replica); "
        "beyond that its attempts are refused with 429 before any comparison",
    )
    migrate_on_start: bool = Field(
        default=True,
        description="upgrade the database schema when the gateway (or kvguard admin) starts",
    )
    database_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="the most any database operation may take (connect, pool checkout, each "
        "round trip; PostgreSQL): past it the request gets its 503 database_unavailable, even "
        "from a frozen server",
    )

    engines: list[EngineSpec] = Field(
        default_factory=list,
        description="engines to route to (JSON list of engine entries, below); --engine adds more",
    )
    engines_file: Path | None = Field(
        default=None,
        description=(
            'a TOML ([[engines]]) or JSON ({"engines": [...]}) file of engine entries, read at '
            "start-up"
        ),
    )
    poll_interval_s: float = Field(
        default=5.0, gt=0, description="how often each engine's capacity is read"
    )
    capacity_stale_after_s: float = Field(
        default=15.0,
        gt=0,
        description=(
            "an engine whose capacity was not read for this long is not routed to (fail closed)"
        ),
    )
    engine_timeout_s: float = Field(
        default=5.0, gt=0, description="bound of one capacity read or token count against an engine"
    )
    upstream_connect_timeout_s: float = Field(
        default=5.0, gt=0, description="bound of connecting to an engine for a completion"
    )
    upstream_read_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="the longest wait for an engine's next bytes during a completion",
    )

    limiter_fail_open: bool = Field(
        default=False,
        description=(
            "let requests through when Redis (the shared limiter) is unreachable; default: "
            "refuse with 503"
        ),
    )
    concurrency_lease_s: float = Field(
        default=60.0,
        gt=1,
        description="a concurrency slot not released (a replica died) frees itself after this",
    )
    limiter_credit_s: float = Field(
        default=1.0,
        ge=0,
        le=10,
        description=(
            "a replica takes this many seconds of a busy tenant's requests and tokens per minute "
            "from Redis in one call and admits from it locally (plans without a concurrency cap; "
            "what it holds is never also in the buckets, and comes back or lapses within it); "
            "0: every request is a call"
        ),
    )

    refuse_on_handoff_mismatch: bool = Field(
        default=True,
        description="refuse (or cut) an answer whose handoff proof shows reserved != transferred; "
        "off only for drills that must let such an answer reach the canary firewall",
    )
    max_body_bytes: int = Field(
        default=8 * MiB, gt=0, description="largest request body accepted (413 beyond)"
    )
    header_timeout_s: float = Field(
        default=15.0, gt=0, description="a client must send its whole request head within this"
    )
    body_timeout_s: float = Field(
        default=60.0, gt=0, description="a client must send its whole request body within this"
    )
    default_max_tokens_cap: int | None = Field(
        default=None,
        gt=0,
        description="a request without max_tokens may generate as many tokens as fit its "
        "engine's limit after the prompt (as OpenAI and vLLM do), at most this many; it is what "
        "admission fits and the limiter takes, and what an engine that reserves KV up front "
        "(the bundled one with KVGUARD_KV_ALLOCATION=reserve) holds per request",
    )
    key_last_used_interval_s: float = Field(
        default=60.0,
        ge=0,
        description="how often a key's last_used_at is written (at most once per interval)",
    )
    auth_cache_ttl_s: float = Field(
        default=1.0,
        ge=0,
        description="how long a replica trusts a verified key without asking the database (0: "
        "never); the keys in use are verified again in the background every half of it, in one "
        "read; revocation through this replica's admin API applies at once, elsewhere within it",
    )
    audit_flush_interval_s: float = Field(
        default=0.5,
        gt=0,
        description="how often audit rows are written to the database in one batch (sooner "
        "when 64 rows wait)",
    )
    responses_retention_days: float = Field(
        default=30.0,
        gt=0,
        le=3650,
        description="how long a stored Responses API response (store: true, OpenAI's default) and "
        "its conversation are kept for its tenant; past it, GET, input_items and "
        "previous_response_id answer 404 at once and the row is purged",
    )

    otlp_endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP collector for the gateway's spans (unset: no spans exported)",
    )
    service_name: str = Field(
        default="kvguard-gateway", description="OpenTelemetry service.name of the gateway's spans"
    )
    cache_salt_key: SecretStr | None = Field(
        default=None,
        description="key of the per-tenant prefix-cache salt sent to vLLM/SGLang (cache_salt); "
        "unset: a random key per process (isolation holds; replicas do not share cache hits)",
    )
    console_session_ttl_s: float = Field(
        default=8 * 3600.0,
        gt=0,
        le=30 * 24 * 3600.0,
        description="how long an operator console sign-in lasts (sessions live in the database, "
        "so every replica honours them; signing out or changing the admin token ends them)",
    )
    console_cookie_secure: bool = Field(
        default=False,
        description="mark the console's cookies Secure even on plain HTTP (TLS ends at a proxy "
        "whose forwarded scheme the gateway does not see); over HTTPS they always are",
    )
    _process_salt_key: bytes = PrivateAttr(default_factory=lambda: secrets.token_bytes(32))
    _trusted: tuple[IPNetwork, ...] = PrivateAttr(default=())

    @field_validator("trusted_proxies")
    @classmethod
    def _check_proxies(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError as exc:
                raise ValueError(
                    f"{entry!r} is not an IP address or network (e.g. 10.0.0.5, 172.30.0.0/24)"
                ) from exc
        return value

    @model_validator(mode="after")
    def _check_deployment(self) -> Self:
        require_real_secret("admin_token", self.admin_token, DEV_ADMIN_TOKEN, self.mode)
        require_real_secret("metrics_token", self.metrics_token, DEV_ADMIN_TOKEN, self.mode)
        require_real_secret("engine_token", self.engine_token, "", self.mode)
        require_strong_if_set("cache_salt_key", self.cache_salt_key, self.mode)
        require_distinct_secrets(self.mode, **self.role_secrets())
        if self.mode is RunMode.PRODUCTION and not self.redis_url:
            raise ValueError("KVGUARD_REDIS_URL is required when KVGUARD_MODE=production")
        if self.capacity_stale_after_s <= self.poll_interval_s:
            raise ValueError("capacity_stale_after_s must exceed poll_interval_s")
        return self

    @model_validator(mode="after")
    def _check_sources(self) -> Self:
        """The database URL parses and the engines file reads: refused at start-up, in one line,
        not as a traceback from the first connection or the lifespan."""
        try:
            make_url(self.sqlalchemy_url())
        except ArgumentError as exc:
            raise ValueError(
                "KVGUARD_DATABASE_URL is not a database URL (e.g. postgresql+psycopg://u:p@host/db)"
            ) from exc
        self.engine_specs()  # the engines file is readable and valid, every name unique
        return self

    def trusted_proxy_networks(self) -> tuple[IPNetwork, ...]:
        """``trusted_proxies`` parsed (once)."""
        if len(self._trusted) != len(self.trusted_proxies):
            self._trusted = tuple(
                ipaddress.ip_network(p, strict=False) for p in self.trusted_proxies
            )
        return self._trusted

    def role_secrets(self) -> dict[str, SecretStr | None]:
        """Every secret this class reads, by setting name: no two roles may share one (with the
        canary's too: ``kvguard gateway`` checks both classes together)."""
        return {
            "admin_token": self.admin_token,
            "metrics_token": self.metrics_token,
            "engine_token": self.engine_token,
            "cache_salt_key": self.cache_salt_key,
        }

    def admin_secret(self) -> str:
        """The admin credential: the configured one, or the development default."""
        if self.admin_token is not None and self.admin_token.get_secret_value():
            return self.admin_token.get_secret_value()
        return DEV_ADMIN_TOKEN

    def cache_salt_secret(self) -> bytes:
        if self.cache_salt_key is not None and self.cache_salt_key.get_secret_value():
            return self.cache_salt_key.get_secret_value().encode()
        return self._process_salt_key

    def metrics_secret(self) -> str | None:
        """The scrape credential for /metrics; ``None`` (open) only in development when unset."""
        if self.metrics_token is not None and self.metrics_token.get_secret_value():
            return self.metrics_token.get_secret_value()
        return None

    def spool_dir(self) -> Path:
        """Where records wait for this deployment's database (``contracts.spool``): per
        database, so two deployments sharing a data dir never write each other's records."""
        url = make_url(self.sqlalchemy_url()).render_as_string(hide_password=True)
        return self.data_dir / "spool" / hashlib.sha256(url.encode()).hexdigest()[:12]

    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'kvguard.db').resolve()}"

    def engine_specs(self) -> list[EngineSpec]:
        """Configured engines: the engines file first, then env/CLI ones; names must be unique."""
        specs = load_engines_file(self.engines_file) if self.engines_file else []
        specs += self.engines
        specs = [with_engine_credential(spec, self.engine_token) for spec in specs]
        names = [spec.name for spec in specs]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"engine names must be unique; repeated: {', '.join(duplicates)}")
        return specs
