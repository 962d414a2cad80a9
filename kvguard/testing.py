"""Helpers for tests and drills that need the real engine as a child process.

``write_tiny_checkpoint`` makes a small random byte-level Llama in Hugging Face layout (it needs
``transformers``, part of the test extra); ``launch_engine`` starts ``kvguard backend ROLE`` on a
free port and waits for its health check; ``serve`` runs an ASGI app (a gateway, a stand-in
engine) under uvicorn on a free 127.0.0.1 port inside the test's own event loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

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
        wait_for_health(self.proc, self.url, f"engine at {self.url}", self._output, timeout_s)

    def _output(self) -> str:
        if self.proc.poll() is None or self.proc.stdout is None:
            return ""  # reading a live process's pipe would block
        return self.proc.stdout.read()

    def stop(self) -> None:
        stop_process(self.proc)


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


def wait_for_health(
    proc: subprocess.Popen[Any],
    url: str,
    name: str,
    tail: Callable[[], str],
    timeout_s: float,
    expect: dict[str, Any] | None = None,
) -> None:
    """Until ``url``/health answers 200 (with every item of ``expect`` in its JSON body, so that
    another server on the same port is not taken for this one); raises with ``tail()`` if
    ``proc`` exits or time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode}: {tail()[-3000:]}")
        try:
            answer = httpx.get(url + "/health", timeout=1.0)
            if answer.status_code == 200:
                body = answer.json() if expect else {}
                wrong = {k: body.get(k) for k, v in (expect or {}).items() if body.get(k) != v}
                if wrong:
                    raise RuntimeError(f"{url} answers as another server ({wrong}), not {name}")
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{name} not healthy in {timeout_s} s: {tail()[-3000:]}")


def stop_process(proc: subprocess.Popen[Any] | None, grace_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; a process that already ended is left alone."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(check: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy (returned); TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


@dataclass
class RunningServer:
    """An app served by ``serve``; ``stop`` ends it (after its open requests, as uvicorn does)."""

    server: Any  # uvicorn.Server
    task: asyncio.Task[None]
    url: str

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def serve(
    app: Any, *, lifespan: Literal["auto", "on", "off"] = "off", timeout_s: float = 30.0
) -> RunningServer:
    """Run an ASGI app under uvicorn on a free 127.0.0.1 port in this event loop, once started
    (its lifespan too, with ``lifespan="on"``); a server that fails to start raises its error."""
    import uvicorn

    from contracts.http_edge import EdgeServer

    # an app that names its own protocol (the gateway's data plane) is served with it
    http = getattr(app, "http_protocol", "auto")
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan=lifespan, http=http
    )
    server = EdgeServer(config)
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn stopped before it started")
        if time.monotonic() > deadline:
            task.cancel()
            raise TimeoutError(f"the server did not start within {timeout_s} s")
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(server=server, task=task, url=f"http://127.0.0.1:{port}")


def interruptible() -> None:
    """``preexec_fn`` for a child a test stops with Ctrl-C (SIGINT): a shell that ran the test
    suite in the background without job control made SIGINT ignored, and children inherit that
    (Python then installs no KeyboardInterrupt handler), so restore the default first."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
