"""The load plan's marker seed: each request slot gets its own nonce, and the same seed gives the
same nonces again (a replayed run sends the same markers)."""

from __future__ import annotations

from dataclasses import replace

from canary.markers import NONCE_BYTES, MarkerCodec, MarkerKeyring
from kvguard.load.plan import LoadPlan, LoadTenant, SizeClass, draw_marker_seed, marker_nonce


def test_a_seed_gives_every_slot_its_own_nonce_and_the_same_ones_again() -> None:
    first = [marker_nonce(7, slot) for slot in range(10_000)]
    assert len(set(first)) == len(first) and {len(n) for n in first} == {NONCE_BYTES}
    assert first == [marker_nonce(7, slot) for slot in range(10_000)]
    assert not set(first) & {marker_nonce(8, slot) for slot in range(10_000)}
    codec = MarkerCodec(MarkerKeyring({1: b"k" * 32}, current=1))
    assert codec.issue("tn_a", nonce=first[3]).text != codec.issue("tn_a", nonce=first[4]).text


def test_fresh_seeds_differ_and_a_plan_keeps_the_one_it_was_given() -> None:
    assert len({draw_marker_seed() for _ in range(100)}) == 100
    plan = LoadPlan(
        gateway="http://127.0.0.1:1",
        model="m",
        limit=384,
        tenants=(LoadTenant(id="tn_a", name="a", key="secret"),),
        sizes=(SizeClass("short", 0, 45, 117, 200),),
        out_dir=".",
        users=1,
        spawn_rate=1.0,
        duration_s=1.0,
        max_requests=None,
        request_timeout_s=1.0,
        stop_timeout_s=1.0,
    )
    assert plan.marker_seed is None  # a plan file for Locust's CLI: each run draws its own
    seeded = replace(plan, marker_seed=2**62)
    assert LoadPlan.from_json(seeded.to_json()) == seeded
    written_before_seeds = plan.to_json()
    del written_before_seeds["marker_seed"]
    assert LoadPlan.from_json(written_before_seeds) == plan
