"""What every deployable's settings class shares: the run mode and the rules for secrets.

Each deployable (backend, gateway, canary) has exactly one pydantic-settings class with
``extra="forbid"`` and the ``KVGUARD_`` prefix, built in its ``main()``/lifespan, never at import.

Secrets outside development (``require_real_secret``, ``require_distinct_secrets``): set, not the
development default, at least ``MIN_SECRET_CHARS`` characters and ``MIN_SECRET_BITS`` of estimated
entropy, and no two roles sharing one. A start-up that refuses its settings prints one line
(``settings_error``) and exits 2.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Sequence
from enum import StrEnum

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError


class RunMode(StrEnum):
    DEVELOPMENT = "development"
    PRODUCTION = "production"


DEV_ADMIN_TOKEN = "kvguard-dev-admin-token"
"""The admin token in development mode when none is set (refused outside development); the
gateway accepts it and the canary's probe runner presents it."""


class KvguardSettings(BaseSettings):
    """Base class: env prefix ``KVGUARD_``, unknown fields refused so typos fail at load."""

    model_config = SettingsConfigDict(env_prefix="KVGUARD_", extra="forbid", frozen=True)

    mode: RunMode = Field(
        default=RunMode.DEVELOPMENT,
        description=(
            "development (default secrets accepted, for one machine) or production (real, "
            "distinct secrets and the production dependencies required)"
        ),
    )


MIN_SECRET_CHARS = 24
MIN_SECRET_BITS = 96
"""Outside development a secret needs this many characters and this many bits of entropy as
``estimated_bits`` judges it (``kvguard canary new-key`` makes 384-bit ones)."""


class DefaultSecretError(ValueError):
    """A secret was left at its development default (or is too weak) outside development mode."""


def estimated_bits(secret: str) -> float:
    """Entropy of ``secret`` estimated from its own characters: the smaller of two estimates,
    each length x the Shannon entropy of a frequency table -- of its characters (catches repeats
    and tiny alphabets: 32 x ``a`` is 0 bits, ``abab...`` 1 bit a character) and of the steps
    between neighbouring characters (catches runs: ``abcdefgh...``, the alphabet typed out, is
    one step repeated, 0 bits). It cannot tell a memorable phrase from a random string (see
    docs)."""
    if not secret:
        return 0.0
    steps = [ord(b) - ord(a) for a, b in itertools.pairwise(secret)]
    return min(_shannon_bits(secret), _shannon_bits(steps) if steps else 0.0)


def _shannon_bits(items: Sequence[object]) -> float:
    counts = Counter(items)
    size = len(items)
    return size * max(0.0, -sum(n / size * math.log2(n / size) for n in counts.values()))


def secret_weakness(secret: str) -> str | None:
    """Why ``secret`` is too weak for production, or None."""
    if len(secret) < MIN_SECRET_CHARS:
        return f"is {len(secret)} characters long; at least {MIN_SECRET_CHARS} are required"
    bits = estimated_bits(secret)
    if bits < MIN_SECRET_BITS:
        return f"is too predictable (~{bits:.0f} bits of entropy; at least {MIN_SECRET_BITS})"
    return None


def require_real_secret(name: str, value: SecretStr | None, default: str, mode: RunMode) -> None:
    """Refuse a missing, default or weak secret unless we run in development mode."""
    if mode is RunMode.DEVELOPMENT:
        return
    env = f"KVGUARD_{name.upper()}"
    if value is None or value.get_secret_value() in ("", default):
        raise DefaultSecretError(
            f"{env} must be set to a real secret when KVGUARD_MODE={mode.value}"
        )
    weakness = secret_weakness(value.get_secret_value())
    if weakness is not None:
        raise DefaultSecretError(
            f"{env} {weakness} when KVGUARD_MODE={mode.value} (`kvguard canary new-key` makes one)"
        )


def require_strong_if_set(name: str, value: SecretStr | None, mode: RunMode) -> None:
    """An optional secret (unset has a safe meaning) must be strong when it is set, outside
    development."""
    if mode is RunMode.DEVELOPMENT or value is None or not value.get_secret_value():
        return
    weakness = secret_weakness(value.get_secret_value())
    if weakness is not None:
        env = f"KVGUARD_{name.upper()}"
        raise DefaultSecretError(
            f"{env} {weakness} when KVGUARD_MODE={mode.value} (`kvguard canary new-key` makes one)"
        )


def require_distinct_secrets(mode: RunMode, **secrets: SecretStr | None) -> None:
    """Refuse two roles sharing one secret (outside development): a leaked scrape credential must
    not also be the admin's, nor the marker key; the engines hold the engine token, so nothing
    else may be it. A deployable that holds several settings classes (``kvguard gateway``: the
    gateway's and the canary's) calls this once with every role of every class."""
    if mode is RunMode.DEVELOPMENT:
        return
    seen: dict[str, str] = {}
    for name, value in secrets.items():
        if value is None or not value.get_secret_value():
            continue
        other = seen.setdefault(value.get_secret_value(), name)
        if other != name:
            raise DefaultSecretError(
                f"KVGUARD_{other.upper()} and KVGUARD_{name.upper()} must be different secrets"
            )


CONFIG_ERRORS: tuple[type[Exception], ...] = (ValidationError, SettingsError)
"""What building a settings class raises for bad input: a value refused (``ValidationError``) or
an environment variable that is not even parsable (``SettingsError``, e.g. a list that is not
JSON). Every command catches these, prints ``settings_error`` and exits 2."""

_UNPARSABLE = re.compile(r'error parsing value for field "(\w+)"')


def settings_error(exc: Exception) -> str:
    """One line for a settings class that refused its input: what is wrong, where."""
    if isinstance(exc, ValidationError):
        parts = []
        for error in exc.errors():
            where = ".".join(str(p) for p in error.get("loc", ()))
            message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
            parts.append(f"{where}: {message}" if where else message)
        text = "; ".join(parts) or str(exc)
    elif (found := _UNPARSABLE.search(str(exc))) is not None:
        cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
        text = f"KVGUARD_{found.group(1).upper()} is not valid JSON{cause}"
    else:
        text = str(exc)
    return " ".join(text.split())
