"""Fixtures of the model tests: the tiny family checkpoints, written once per session."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Test modules are imported in importlib mode (sys.path untouched): make the helpers importable.
sys.path.insert(0, str(Path(__file__).parent))

from tiny_families import FAMILIES, write_family


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``family_checkpoint("qwen2")``: that family's tiny checkpoint, written on first use."""
    written: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in written:
            written[name] = write_family(FAMILIES[name], tmp_path_factory.mktemp(name))
        return written[name]

    return get


@pytest.fixture(scope="session")
def hf_family(family_checkpoint: Callable[[str], Path]) -> Callable[[str], tuple[Any, Any]]:
    """``hf_family("qwen2")``: transformers' (tokenizer, model) of that checkpoint, loaded once."""
    import transformers

    loaded: dict[str, tuple[Any, Any]] = {}

    def get(name: str) -> tuple[Any, Any]:
        if name not in loaded:
            path = family_checkpoint(name)
            tok = transformers.AutoTokenizer.from_pretrained(path)
            model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            loaded[name] = (tok, model)
        return loaded[name]

    return get


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """These tiny models run 50x slower on two threads than on one when the machine is busy (the
    engine processes the tests start use one thread too, KVGUARD_TORCH_THREADS=1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
