"""Start-up limits: a window larger than the real pool is refused with the one drift statement,
or, when drift is allowed, kept and reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.config import BackendSettings
from backend.core.admission import CapacityLimits
from backend.engine.build import CapacityDriftRefused, decide_limits
from backend.model.config import ModelConfig


def _config(checkpoint: str) -> ModelConfig:
    return ModelConfig.from_dir(Path(checkpoint))


def test_a_window_over_the_pool_is_refused_with_the_drift_statement(tiny_checkpoint: str) -> None:
    settings = BackendSettings(model=tiny_checkpoint, pool_tokens=256, context_window=1024)
    with pytest.raises(CapacityDriftRefused) as refused:
        decide_limits(settings, _config(tiny_checkpoint), pages=16)
    assert str(refused.value) == (
        "context window 1024 exceeds the real KV pool of 256 tokens (16 pages x 16); requests "
        "are limited to 256 tokens. Lower --context-window, raise the pool, or pass "
        "--allow-capacity-drift to run anyway (requests stay limited to the pool and the drift "
        "is reported)"
    )
    assert str(refused.value).startswith(f"{CapacityLimits(16, 16, 1024).drift}. ")


def test_allowed_drift_keeps_the_window_and_reports_it(tiny_checkpoint: str) -> None:
    settings = BackendSettings(
        model=tiny_checkpoint, pool_tokens=256, context_window=1024, allow_capacity_drift=True
    )
    limits = decide_limits(settings, _config(tiny_checkpoint), pages=16)
    assert limits == CapacityLimits(page_size=16, pool_pages=16, context_window=1024)
    assert limits.max_request_tokens == 256 and limits.drift is not None
