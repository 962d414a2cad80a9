"""`kvguard backend ...` arguments -> BackendSettings: what the command line really turns on."""

from __future__ import annotations

import pytest

from backend.cli import settings_from_args
from backend.config import BackendSettings
from backend.disagg.faults import FaultDrillRefused, FaultSet
from kvguard.cli import build_parser


def _settings(*argv: str) -> BackendSettings:
    return settings_from_args(build_parser().parse_args(["backend", *argv]))


def test_repeated_fault_flags_all_land_in_the_settings() -> None:
    settings = _settings(
        "decode",
        "--prefill-url",
        "http://127.0.0.1:1",
        "--allow-fault-drills",
        "--fault",
        "skip_checksum",
        "--fault",
        "early_release_on_abort",
    )
    assert settings.allow_fault_drills is True
    assert settings.faults == ["skip_checksum", "early_release_on_abort"]
    assert settings.prefill_url == "http://127.0.0.1:1"


def test_no_fault_flags_mean_no_faults_and_drills_not_allowed() -> None:
    settings = _settings("prefill")
    assert settings.faults == [] and settings.allow_fault_drills is False


def test_a_fault_without_allow_fault_drills_is_refused_for_the_role() -> None:
    settings = _settings("prefill", "--fault", "legacy_reject_handoff")
    with pytest.raises(FaultDrillRefused, match="need --allow-fault-drills"):
        FaultSet.parse(settings.faults, role="prefill", allowed=settings.allow_fault_drills)
