"""Helpers for tests and drills that need the real engine as a child process.

``write_tiny_checkpoint`` makes a small random byte-level Llama in Hugging Face layout (it needs
``transformers``, part of the test extra); ``launch_engine`` starts ``kvguard backend ROLE`` on a
free port and waits for its health check.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from kvguard.localservices import free_port


def write_tiny_checkpoint(directory: os.PathLike[str] | str, *, seed: int = 0) -> str:
    """A small randomly initialised byte-level Llama in HF layout (for engine plumbing tests)."""
    import json
    from pathlib import Path

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(directory)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    raw = json.loads((path / "config.json").read_text())
    raw["kvguard_tokenizer"] = "byte"
    raw["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return str(path)


class EngineProcess:
    """A `kvguard backend ...` child process on a free port, stopped by the fixture."""

    def __init__(self, argv: list[str], url: str, env: dict[str, str]) -> None:
        self.url = url
        self.argv = argv
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read() if self.proc.stdout else ""
                raise RuntimeError(f"engine exited with {self.proc.returncode}: {out[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"engine at {self.url} not healthy within {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def launch_engine(
    model: str, role: str = "unified", env: dict[str, str] | None = None, **options: object
) -> EngineProcess:
    """Start ``kvguard backend ROLE`` on a free port and wait until it is healthy.

    Keyword options map to command-line flags (``allow_capacity_drift=True`` adds the bare flag);
    ``env`` adds KVGUARD_* variables for settings without a flag.
    """

    port = free_port()
    argv = [sys.executable, "-m", "kvguard", "backend", role, "--port", str(port)]
    argv += ["--model", model]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    child_env = {**os.environ, "KVGUARD_TORCH_THREADS": "1", **(env or {})}
    engine = EngineProcess(argv, f"http://127.0.0.1:{port}", child_env)
    try:
        engine.wait_healthy()
    except BaseException:
        engine.stop()
        raise
    return engine
