"""Canary settings: default secrets refused outside development, key rotation by key id."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from canary.config import DEV_CANARY_KEY, CanarySettings, new_key
from canary.markers import MarkerCodec

KEY_A = "a" * 40
KEY_B = "b" * 40
# Production refuses predictable secrets (32 x "a"): these pass its entropy check.
REAL_KEY = "Kq7-canary-key-3Vn8xLp2-Wd5mR9tB4s6h"
REAL_ADMIN = "Zq3-admin-token-7Hx0pLw9-vK2mR5tN8s"


def test_development_runs_on_the_known_default_key() -> None:
    settings = CanarySettings()
    ring = settings.keyring()
    assert ring.key_ids == (1,) and ring.get(1) == DEV_CANARY_KEY.encode()


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"KVGUARD_CANARY_KEY": DEV_CANARY_KEY},
        {"KVGUARD_CANARY_KEY": ""},
    ],
)
def test_production_refuses_a_missing_or_default_key(monkeypatch, env) -> None:
    monkeypatch.setenv("KVGUARD_MODE", "production")
    monkeypatch.setenv("KVGUARD_ADMIN_TOKEN", REAL_ADMIN)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match="CANARY_KEY"):
        CanarySettings()


def test_production_accepts_a_real_key_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("KVGUARD_MODE", "production")
    monkeypatch.setenv("KVGUARD_ADMIN_TOKEN", REAL_ADMIN)
    monkeypatch.setenv("KVGUARD_CANARY_KEY", REAL_KEY)
    monkeypatch.setenv("KVGUARD_REDIS_URL", "redis://x")  # a gateway setting: ignored here
    assert CanarySettings().keyring().get(1) == REAL_KEY.encode()


def test_production_refuses_the_default_admin_token(monkeypatch) -> None:
    monkeypatch.setenv("KVGUARD_MODE", "production")
    monkeypatch.setenv("KVGUARD_CANARY_KEY", REAL_KEY)
    with pytest.raises(ValidationError, match="ADMIN_TOKEN"):
        CanarySettings()


def test_short_keys_and_clashing_ids_are_refused() -> None:
    with pytest.raises(ValidationError, match="at least 32 bytes"):
        CanarySettings(canary_key="short")
    with pytest.raises(ValidationError, match="at least 32 bytes"):
        CanarySettings(canary_key=KEY_A, canary_key_id=2, canary_previous_keys={1: "tiny"})
    with pytest.raises(ValidationError, match="must differ"):
        CanarySettings(canary_key=KEY_A, canary_key_id=1, canary_previous_keys={1: KEY_B})
    with pytest.raises(ValidationError):
        CanarySettings(canary_key=KEY_A, canary_key_id=256)
    with pytest.raises(ValidationError):
        CanarySettings(canary_typo=True)


def test_rotation_issues_with_the_new_id_and_still_verifies_the_old(monkeypatch) -> None:
    before = MarkerCodec(CanarySettings(canary_key=KEY_A, canary_key_id=1).keyring())
    old_marker = before.issue("tenant-1")
    monkeypatch.setenv("KVGUARD_CANARY_KEY", KEY_B)
    monkeypatch.setenv("KVGUARD_CANARY_KEY_ID", "2")
    monkeypatch.setenv("KVGUARD_CANARY_PREVIOUS_KEYS", '{"1": "' + KEY_A + '"}')
    after = MarkerCodec(CanarySettings().keyring())
    new_marker = after.issue("tenant-1")
    assert new_marker.key_id == 2 and after.keyring.key_ids == (1, 2)
    verified = after.verify(old_marker.text)
    assert verified is not None and verified.key_id == 1
    assert before.verify(new_marker.text) is None
    monkeypatch.delenv("KVGUARD_CANARY_PREVIOUS_KEYS")  # key 1 retired
    dropped = MarkerCodec(CanarySettings().keyring())
    assert dropped.verify(old_marker.text) is None


def test_secrets_stay_out_of_reprs_and_new_keys_are_long_and_fresh() -> None:
    settings = CanarySettings(canary_key=KEY_A)
    assert KEY_A not in repr(settings) and KEY_A not in repr(settings.keyring())
    keys = {new_key() for _ in range(50)}
    assert len(keys) == 50 and all(len(k) == 64 for k in keys)
    assert CanarySettings(canary_key=new_key()).keyring().current_id == 1
