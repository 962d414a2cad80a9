"""Faults under load on one real stack (``bench.fault_stack``: gateway + decode + prefill with the
bundled model, private Redis and PostgreSQL, all on 127.0.0.1): each test breaks one part while
content-checked clients run (every request asks for its own canary marker back), clears the fault
and asserts on the scenario's row (``bench.faults``).

What every row must show (``assert_recovered``): no foreign marker was ever delivered, no 200 came
back without its own marker and no stream ended silently, every error carried an OpenAI-style code
(never a 500 ``internal_error``), the stack served correctly again, the tenant could open its whole
concurrency cap at once afterwards (no leaked slot), both KV pools and prefill's staging drained
with ``free + owned + quarantined == total``, and every request the gateway numbered has exactly
one audit row that agrees with what the client saw. Each test then asserts the fault's own effect.
"""

from __future__ import annotations

import pytest

from bench.fault_load import Outcome, codec_for, engine_copies
from bench.fault_stack import FaultStack
from bench.faults import (
    MODEL_MISS_KEY,
    FaultRow,
    _attributed,
    cancel_storm,
    decode_crash,
    postgres_down,
    prefill_crash,
    redis_down,
    slow_transfer,
)

pytestmark = pytest.mark.slow

# Clear errors a client may get while a part is broken (each an OpenAI-style code).
CLEAR = {
    "no_healthy_engine",  # the gateway sees the engine down or its path unavailable
    "token_count_unavailable",  # the engine's tokenizer cannot be reached to count the prompt
    "engine_overloaded",  # decode answered 503 (prefill unknown or gone)
    "upstream_error",  # the engine's connection broke mid-stream
    "prefill_unavailable",  # decode lost prefill during a handoff
    "kv_handoff_timeout",  # decode's handoff lease ended before the KV arrived
    "kv_handoff_failed",  # prefill's lease ended during the transfer: it stopped writing
    "limiter_unavailable",  # Redis unreachable: limited tenants fail closed
    "database_unavailable",  # PostgreSQL unreachable: keys cannot be checked
}


def cap(stack: FaultStack) -> int:
    """The load tenant's concurrency cap (the clients run at the cap)."""
    assert stack.tenant is not None
    return stack.tenant.max_concurrency


def assert_recovered(row: FaultRow, slots: int) -> None:
    assert row.leaked_markers == 0, row
    assert row.wrong_content == 0, row
    assert row.unclear_errors == 0, row
    answered = ("ok", "cancelled", MODEL_MISS_KEY)  # a model miss: the engine's own answer
    codes = {key.partition(":")[2] for key in row.during if key not in answered}
    assert codes <= CLEAR, row
    assert row.recovery_s is not None, row
    assert sum(row.after.get(key, 0) for key in ("ok", MODEL_MISS_KEY)) == slots, row
    assert row.pool_violations == [], row
    assert row.audit_problems == [], row
    assert row.passed


async def test_decode_killed_mid_stream_cuts_with_an_error_event_and_recovers(
    stack: FaultStack,
) -> None:
    row = await decode_crash(stack, n_clients=cap(stack), hold_s=0.5)
    assert_recovered(row, cap(stack))
    # The kill landed while a stream was delivering text: that stream ended with an error event.
    assert row.during.get("cut:upstream_error", 0) >= 1, row


async def test_prefill_killed_mid_transfer_fails_the_handoffs_and_drains_decode(
    stack: FaultStack,
) -> None:
    row = await prefill_crash(stack, n_clients=cap(stack), hold_s=0.5)
    assert_recovered(row, cap(stack))
    assert row.during.get("cut:prefill_unavailable", 0) >= 1, row
    assert row.drained_pages > 0, row  # the pages prefill was writing were quarantined, then freed


async def test_slow_transfer_past_the_lease_ends_with_timeouts_and_drains(
    stack: FaultStack,
) -> None:
    row = await slow_transfer(stack, n_clients=cap(stack), hold_s=4.0)
    assert_recovered(row, cap(stack))
    assert row.during.get("cut:kv_handoff_timeout", 0) >= 1, row
    assert row.drained_pages > 0, row


async def test_redis_unreachable_fails_closed_and_gives_every_slot_back(stack: FaultStack) -> None:
    row = await redis_down(stack, n_clients=cap(stack), hold_s=1.5)
    # row.after: every slot usable at once right after Redis returns
    assert_recovered(row, cap(stack))
    assert row.during.get("error:limiter_unavailable", 0) >= 1, row


async def test_postgres_unreachable_is_a_503_and_the_audit_catches_up(stack: FaultStack) -> None:
    row = await postgres_down(stack, n_clients=cap(stack), hold_s=1.5)
    # row.audit_problems: the rows of requests during the outage were written after it
    assert_recovered(row, cap(stack))
    assert row.during.get("error:database_unavailable", 0) >= 1, row


async def test_cancelling_many_streams_releases_everything(stack: FaultStack) -> None:
    row = await cancel_storm(stack, n_clients=cap(stack), hold_s=1.5)
    assert_recovered(row, cap(stack))
    assert set(row.during) == {"cancelled"} and row.requests >= cap(stack), row


async def test_a_missing_marker_is_the_models_only_if_the_engine_itself_misses_it(
    stack: FaultStack,
) -> None:
    """``bench.faults`` calls a 200 without its own marker a model miss, not wrong content, only
    when the engine asked directly answers without it too: a marker the engine copies, or one a
    gateway answer lost, stays wrong."""
    codec = codec_for(stack.canary_key)
    marker = codec.issue(stack.tenant.id).text
    assert await engine_copies(stack.decode.url, stack.engine_token, marker)
    lost = Outcome("wrong", "no_own_marker", 200, "r1", marker=marker)
    assert (await _attributed(stack, lost)).kind == "wrong"  # the engine copies this one
    # no marker shape in the prompt: the model has nothing to copy, so it misses this text
    plain = Outcome("wrong", "no_own_marker", 200, "r2", marker="plain words, no code")
    assert (await _attributed(stack, plain)).kind == "model_miss"
    cut = Outcome("wrong", "silent_cut", 200, "r3", marker=marker)
    assert (await _attributed(stack, cut)).kind == "wrong"  # a cut stream is never the model's
