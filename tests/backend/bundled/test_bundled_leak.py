"""The stale-KV leak drill on the shipped weights: stale pages leak A's marker, controls never do.

A small, seeded sample of the incident-shaped drill (see backend.bundled.leak), through the
engine's page pool, paged KV cache and paged attention; evaluate.py runs the full table. A
regression in the weights or in the engine's page read path makes this fail.
"""

from __future__ import annotations

import pytest
import torch

from backend.bundled.evaluate import DEFAULT_MODEL
from backend.bundled.leak import EngineKV, load_engine_model, run_leak
from backend.core.errors import IsolationError
from backend.core.pages import Owner
from backend.model.llama import LlamaModel

TRIALS = 16
SEED = 4_000


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    torch.set_num_threads(2)
    return load_engine_model(DEFAULT_MODEL)


def test_stale_pages_leak_the_previous_tenants_marker(model: LlamaModel) -> None:
    rates = run_leak(model, "incident", None, TRIALS, SEED)
    assert rates.a_answered >= 0.75  # A itself got its marker back: the drill means something
    assert rates.attributable >= 0.75
    assert rates.complete >= 0.5


def test_stale_pages_read_at_other_positions_leak_too(model: LlamaModel) -> None:
    """The disaggregated incident's layout: fresh pages first, A's pages after them, so A's K/V
    sits at positions it was not computed at; the model still turns it into A's marker."""
    rates = run_leak(model, "shifted", None, TRIALS, SEED)
    assert rates.a_answered >= 0.75
    assert rates.attributable >= 0.75
    assert rates.complete >= 0.5


@pytest.mark.parametrize("variant", ["incident", "shifted"])
@pytest.mark.parametrize("control", ["zeroed", "correct"])
def test_zeroed_pages_and_correct_tables_never_leak(
    model: LlamaModel, variant: str, control: str
) -> None:
    rates = run_leak(model, variant, control, TRIALS, SEED)
    assert rates.a_answered >= 0.75
    assert rates.attributable == 0.0
    assert rates.complete == 0.0


def test_the_drill_reads_through_the_engine_pool_and_checks_ownership(model: LlamaModel) -> None:
    """B's table is A's pages in A's order, handed out by the pool; a stale ref is refused."""
    kv = EngineKV(model, 3, zero_on_free=False)
    a, b = Owner("a", "tenant-a"), Owner("b", "tenant-b")
    refs_a = kv.allocate(a)
    kv.forward(refs_a, a, [256, 1, 2], 0)
    kv.free(refs_a, a)
    refs_b = kv.allocate(b)
    assert [r.page_id for r in refs_b] == [r.page_id for r in refs_a]
    assert all(rb.generation == ra.generation + 1 for ra, rb in zip(refs_a, refs_b, strict=True))
    with pytest.raises(IsolationError):
        kv.forward(refs_a, a, [3], 3)  # A's old refs name a generation that is gone
