"""One adapter per engine kind; ``adapter_for`` picks it from the spec."""

from __future__ import annotations

from gateway.engines.adapters.base import AdapterError, EngineAdapter
from gateway.engines.adapters.bundled import BundledAdapter
from gateway.engines.adapters.openai_generic import DeclaredAdapter
from gateway.engines.adapters.sglang import SGLangAdapter
from gateway.engines.adapters.vllm import VLLMAdapter
from gateway.engines.spec import EngineKind, EngineSpec

_ADAPTERS: dict[EngineKind, type[EngineAdapter]] = {
    EngineKind.BUNDLED: BundledAdapter,
    EngineKind.SGLANG: SGLangAdapter,
    EngineKind.VLLM: VLLMAdapter,
    EngineKind.OPENAI: DeclaredAdapter,
    EngineKind.LITELLM: DeclaredAdapter,
}


def adapter_for(spec: EngineSpec) -> EngineAdapter:
    return _ADAPTERS[spec.kind](spec)


__all__ = ["AdapterError", "EngineAdapter", "adapter_for"]
