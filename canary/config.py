"""The canary's one settings class (``KVGUARD_CANARY_*``), read by the gateway's firewall and by
``kvguard canary probe``; built in ``main()``/lifespan, never at import.

Keys: ``KVGUARD_CANARY_KEY`` (at least 32 bytes of UTF-8) issues new markers under key id
``KVGUARD_CANARY_KEY_ID``; ``KVGUARD_CANARY_PREVIOUS_KEYS`` (JSON ``{"<id>": "<key>"}``) still
verify, so markers issued before a rotation stay attributable until their id is dropped. To
rotate: move the current key into the previous keys, set a new key under a new id, restart the
replicas one by one (every replica verifies both ids throughout). Outside development mode a
missing key, or the development default, is refused at start.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Self

from pydantic import Field, SecretStr, model_validator

from canary.markers import MAX_KEY_ID, MIN_KEY_BYTES, MarkerKeyring
from contracts.settings import (
    DEV_ADMIN_TOKEN,
    KvguardSettings,
    RunMode,
    require_distinct_secrets,
    require_real_secret,
)

DEV_CANARY_KEY = "kvguard-dev-canary-key-known-to-everyone"

KeyId = Annotated[int, Field(ge=0, le=MAX_KEY_ID)]


class CanarySettings(KvguardSettings):
    """Marker keys, firewall policy, lower-severity checks and the probe runner."""

    canary_enabled: bool = Field(
        default=True,
        description=(
            "the leak firewall and marker injection (off: responses are not scanned, a warning "
            "is logged)"
        ),
    )
    canary_key: SecretStr | None = Field(
        default=None,
        description=(
            "the marker key (>= 32 bytes; `kvguard canary new-key`); required outside "
            "development, where unset means a well-known key"
        ),
    )
    canary_key_id: KeyId = Field(
        default=1,
        description=(
            "key id of KVGUARD_CANARY_KEY, written into new markers (0-255; rotate by bumping it)"
        ),
    )
    canary_previous_keys: dict[KeyId, SecretStr] = Field(
        default_factory=dict,
        description=(
            "earlier keys by key id (JSON object), still accepted when scanning after a rotation"
        ),
    )

    canary_quarantine_on_cut: bool = Field(
        default=True,
        description="take the engine out of routing when the firewall cuts a stream (an admin "
        "clears it); off only where an engine must keep serving while findings are reviewed",
    )
    canary_quarantine_on_suspected: bool = Field(
        default=False,
        description="with canary_quarantine_on_cut: quarantine for every suspected finding (a "
        "damaged copy showing a foreign tenant's tag, no MAC) that is no replay. Off by default: "
        "suspected findings quarantine only when corroborated (canary_corroboration_*)",
    )
    canary_corroboration_window_s: float = Field(
        default=600.0,
        gt=0,
        description="suspected findings quarantine an engine when, within this many seconds, "
        "copies showing a victim's nonce from requests that engine served reach "
        "canary_corroboration_tenants different requesting tenants (canary/README.md)",
    )
    canary_corroboration_tenants: int = Field(
        default=2,
        ge=2,
        le=1000,
        description="how many different requesting tenants' suspected findings corroborate each "
        "other (at least 2: one requester's findings never suffice on their own)",
    )
    canary_inject_completions: bool = Field(
        default=True,
        description="also mark /v1/completions prompts (a reference line before the prompt)",
    )
    canary_record_ttl_s: float = Field(
        default=86_400.0,
        gt=0,
        description="how long a marker's issue record (which request, tenant and engine) is kept",
    )
    canary_tag_refresh_s: float = Field(
        default=30.0,
        gt=0,
        description="how often the tenant tag index is rebuilt from the tenants table",
    )

    canary_usage_check: bool = Field(
        default=True,
        description=(
            "record a low finding when an engine's usage.prompt_tokens disagrees with the "
            "gateway's count"
        ),
    )
    canary_ttft_check: bool = Field(
        default=True,
        description=(
            "record a low finding when a first token comes back implausibly fast for the "
            "prompt's size"
        ),
    )
    canary_ttft_min_prompt_tokens: int = Field(
        default=256,
        gt=0,
        description="prompts shorter than this are not judged by the first-token check",
    )
    canary_ttft_ratio: float = Field(
        default=0.2,
        gt=0,
        lt=1,
        description=(
            "a first token faster than this fraction of the engine's typical one (per prompt "
            "token) is a finding"
        ),
    )
    canary_ttft_history: int = Field(
        default=200, ge=10, description="first-token timings kept per engine to judge against"
    )
    canary_ttft_min_samples: int = Field(
        default=20, ge=5, description="timings an engine needs before its first tokens are judged"
    )
    canary_finding_interval_s: float = Field(
        default=60.0,
        ge=0,
        description="lower-severity findings: at most one stored per engine and kind per "
        "interval (the metric counts every one)",
    )

    canary_gateway_url: str | None = Field(
        default=None, description="kvguard canary probe / findings / load: the gateway to call"
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description=(
            "kvguard canary probe / findings: the gateway's admin token (development: the dev "
            "token)"
        ),
    )
    canary_probe_interval_s: float = Field(
        default=60.0, gt=0, description="kvguard canary probe: seconds between probe rounds"
    )
    canary_probe_timeout_s: float = Field(
        default=60.0, gt=0, description="kvguard canary probe: bound of one probe request"
    )
    canary_probe_tenant_prefix: str = Field(
        default="canary-probe",
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="kvguard canary probe: name prefix of the synthetic tenants it creates",
    )

    @model_validator(mode="after")
    def _check_keys(self) -> Self:
        require_real_secret("canary_key", self.canary_key, DEV_CANARY_KEY, self.mode)
        require_real_secret("admin_token", self.admin_token, DEV_ADMIN_TOKEN, self.mode)
        for key_id, previous in self.canary_previous_keys.items():
            require_real_secret(
                f"canary_previous_keys[{key_id}]", previous, DEV_CANARY_KEY, self.mode
            )
        require_distinct_secrets(self.mode, **self.role_secrets())
        if self.canary_key_id in self.canary_previous_keys:
            raise ValueError("KVGUARD_CANARY_KEY_ID must differ from every previous key's id")
        for key_id, key in self._secrets().items():
            if len(key) < MIN_KEY_BYTES:
                raise ValueError(f"canary key {key_id} must be at least {MIN_KEY_BYTES} bytes")
            if self.mode is not RunMode.DEVELOPMENT and key == DEV_CANARY_KEY.encode():
                raise ValueError(f"canary key {key_id} is the development default")
        return self

    def role_secrets(self) -> dict[str, SecretStr | None]:
        """Every secret this class reads, by setting name (no two roles may share one; with the
        gateway's: ``contracts.settings.require_distinct_secrets``)."""
        previous = {f"canary_previous_keys[{k}]": v for k, v in self.canary_previous_keys.items()}
        return {"canary_key": self.canary_key, **previous, "admin_token": self.admin_token}

    def _secrets(self) -> dict[int, bytes]:
        current = self.canary_key.get_secret_value() if self.canary_key else DEV_CANARY_KEY
        keys = {k: v.get_secret_value().encode() for k, v in self.canary_previous_keys.items()}
        keys[self.canary_key_id] = current.encode()
        return keys

    def keyring(self) -> MarkerKeyring:
        """The current key (issues) and every previous key (still verifies)."""
        return MarkerKeyring(self._secrets(), current=self.canary_key_id)

    def admin_secret(self) -> str:
        if self.admin_token is not None and self.admin_token.get_secret_value():
            return self.admin_token.get_secret_value()
        return DEV_ADMIN_TOKEN


def new_key() -> str:
    """A fresh random canary key (64 URL-safe characters, 384 bits)."""
    return secrets.token_urlsafe(48)
