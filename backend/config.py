"""Settings of the bundled engine (every role: unified, prefill, decode).

Built once in the role's ``main()`` from ``KVGUARD_*`` environment variables and command-line
overrides; nothing reads the environment anywhere else in ``backend/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from kvguard.settings import KvguardSettings

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "bundled" / "kvguard-tiny"


class BackendSettings(KvguardSettings):
    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=1, le=65535)
    model: Path = Field(default=BUNDLED_MODEL_DIR, description="checkpoint directory (HF layout)")
    served_model_name: str | None = Field(
        default=None, description="model id in the API; default: the checkpoint dir's name"
    )
    page_size: int = Field(default=16, ge=1, le=4096, description="tokens per KV page")
    pool_tokens: int | None = Field(
        default=None, ge=1, description="KV pool size in tokens (wins over kv_memory_bytes)"
    )
    kv_memory_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1,
        description="memory budget for the KV pool when pool_tokens is unset",
    )
    context_window: int | None = Field(
        default=None, ge=1, description="advertised window; default: the model's, capped by pool"
    )
    allow_capacity_drift: bool = Field(
        default=False, description="start even if the window exceeds the real pool (reported)"
    )
    zero_on_free: bool = True
    max_batch_tokens: int = Field(default=2048, ge=1, description="tokens per forward step")
    max_running: int = Field(default=64, ge=1, description="sequences decoding at once")
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    device: str = "cpu"
    torch_threads: int | None = Field(default=None, ge=1)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    request_timeout_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _check_model_dir(self) -> BackendSettings:
        if not self.model.is_dir():
            raise ValueError(f"model directory {self.model} does not exist")
        return self
