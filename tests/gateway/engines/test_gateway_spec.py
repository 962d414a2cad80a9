"""The engine domain (``gateway.engines.spec``): an engine entry's rules, refused at load."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.engines.spec import EngineSpec, UpstreamPath


def test_engine_spec_rules() -> None:
    with pytest.raises(ValidationError, match="declared_max_model_len"):
        EngineSpec(name="x", kind="openai", base_url="http://x")
    with pytest.raises(ValidationError, match="litellm_model"):
        EngineSpec(
            name="x", kind="litellm", base_url="http://x", model="m", declared_max_model_len=9
        )
    with pytest.raises(ValidationError, match="http"):
        EngineSpec(name="x", base_url="ftp://x")
    spec = EngineSpec(
        name="x",
        kind="litellm",
        base_url="http://x/",
        model="m",
        declared_max_model_len=9,
        litellm_model="openai/m",
    )
    assert (spec.base_url, spec.upstream_path) == ("http://x", UpstreamPath.LITELLM)
