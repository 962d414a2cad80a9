"""What every deployable's settings class shares: the run mode and the default-secret rule.

Each deployable (backend, gateway, canary) has exactly one pydantic-settings class with
``extra="forbid"`` and the ``KVGUARD_`` prefix, built in its ``main()``/lifespan, never at import.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class RunMode(StrEnum):
    DEVELOPMENT = "development"
    PRODUCTION = "production"


class KvguardSettings(BaseSettings):
    """Base class: env prefix ``KVGUARD_``, unknown fields refused so typos fail at load."""

    model_config = SettingsConfigDict(env_prefix="KVGUARD_", extra="forbid", frozen=True)

    mode: RunMode = RunMode.DEVELOPMENT


class DefaultSecretError(ValueError):
    """A secret was left at its development default outside development mode."""


def require_real_secret(name: str, value: SecretStr | None, default: str, mode: RunMode) -> None:
    """Refuse a missing or default secret unless we run in development mode."""
    if mode is RunMode.DEVELOPMENT:
        return
    if value is None or value.get_secret_value() in ("", default):
        raise DefaultSecretError(
            f"KVGUARD_{name.upper()} must be set to a real secret when KVGUARD_MODE={mode.value}"
        )
