"""Without Mooncake installed: start-up says what is missing and names the single-host fallback.

The failed import is simulated (``None`` in ``sys.modules`` makes ``import mooncake`` raise
ImportError), in this process and in a real ``kvguard backend prefill`` process.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from backend.config import BackendSettings
from backend.server.roles import make_transport
from backend.transport.base import TransportUnavailable
from backend.transport.loopback import LoopbackTransport
from backend.transport.mooncake import MooncakeTransport

FALLBACK = "KVGUARD_TRANSPORT=loopback"


def _without_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("mooncake", "mooncake.engine"):
        monkeypatch.setitem(sys.modules, name, None)


def test_missing_mooncake_names_the_package_and_the_loopback_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_mooncake(monkeypatch)
    with pytest.raises(TransportUnavailable) as refused:
        MooncakeTransport("127.0.0.1")
    message = str(refused.value)
    assert "mooncake-transfer-engine-non-cuda" in message
    assert "separate hosts" in message and FALLBACK in message
    # The setting the message names is the real one: it selects the loopback transport.
    monkeypatch.setenv(*FALLBACK.split("="))
    transport = make_transport(BackendSettings())
    try:
        assert isinstance(transport, LoopbackTransport)
    finally:
        transport.close()


def test_prefill_without_mooncake_exits_2_cannot_start(tiny_checkpoint: str) -> None:
    hide = "import sys; sys.modules['mooncake'] = sys.modules['mooncake.engine'] = None; "
    run = "from kvguard.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", hide + run, "backend", "prefill", "--port", "1"]
    argv += ["--model", tiny_checkpoint, "--pool-tokens", "256"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "kvguard backend prefill: cannot start:" in result.stderr
    assert FALLBACK in result.stderr


class _BrokenNativeModule:
    """A meta path finder whose ``mooncake.engine`` fails as a native module does when a library
    it links against is missing (the message is the dynamic loader's)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "mooncake.engine":
            raise ImportError(
                "libibverbs.so.1: cannot open shared object file: No such file or directory"
            )
        return None


def test_a_missing_system_library_is_named_with_its_packages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenNativeModule(), *sys.meta_path])
    with pytest.raises(TransportUnavailable) as refused:
        MooncakeTransport("127.0.0.1")
    message = str(refused.value)
    assert "libibverbs.so.1: cannot open shared object file" in message
    assert "libibverbs1 libnuma1 libcurl4" in message and "not installed" not in message
