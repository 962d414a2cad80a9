"""The engine core over the real model and KV cache: read-path checks, zeroing, aborts."""

from __future__ import annotations

import random

import torch

from backend.config import BackendSettings
from backend.core.errors import IsolationError
from backend.core.pages import Owner
from backend.core.request import Request, RequestState, SamplingParams
from backend.engine.build import build_engine


def _build(checkpoint: str, *, pool_tokens: int = 256, zero_on_free: bool = True):  # type: ignore[no-untyped-def]
    # Without the prefix cache: these tests follow each page from allocation to zeroing (cached
    # pages outlive their request; the cache's lifecycle has its own tests below and in core).
    settings = BackendSettings(
        model=checkpoint,
        pool_tokens=pool_tokens,
        page_size=16,
        zero_on_free=zero_on_free,
        max_batch_tokens=64,
        max_running=8,
        prefix_cache=False,
    )
    return build_engine(settings)


def _request(rid: str, tenant: str, n_prompt: int, max_tokens: int = 4) -> Request:
    prompt = [256] + [97 + (i % 26) for i in range(n_prompt - 1)]
    return Request(rid, tenant, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_stale_generation_fails_only_that_request(tiny_checkpoint: str) -> None:
    built = _build(tiny_checkpoint)
    core, pool = built.engine.core, built.pool
    victim, bystander = _request("victim", "tenant-a", 20), _request("ok", "tenant-b", 20)
    core.add(victim)
    core.add(bystander)
    core.step()  # both prefilled, first tokens sampled
    assert victim.state is RequestState.DECODING and bystander.state is RequestState.DECODING
    # Simulate the incident's hazard: the victim's page is freed and handed to someone else
    # behind its back, so its table still names (page, old generation).
    stolen = victim.page_table[0]
    pool.free([stolen], victim.owner)
    pool.confirm_zeroed([stolen.page_id])
    thief = Owner("thief", "tenant-c")
    while True:
        refs = pool.allocate(1, thief)
        if refs[0].page_id == stolen.page_id:
            break
    outcome = core.step()
    assert [r.request_id for r in outcome.failed] == ["victim"]
    assert victim.state is RequestState.FAILED
    assert isinstance(victim.error, IsolationError)
    assert victim.error.code == "kv_isolation_violation"
    assert bystander.state in (RequestState.DECODING, RequestState.FINISHED)
    assert "thief" not in str(victim.error) and "tenant-c" not in str(victim.error)


def test_freed_pages_are_zeroed_before_reuse(tiny_checkpoint: str) -> None:
    built = _build(tiny_checkpoint)
    core, pool, cache = built.engine.core, built.pool, built.kv_cache
    request = _request("r1", "tenant-a", 40, max_tokens=2)
    core.add(request)
    core.step()
    pages = [ref.page_id for ref in request.page_table]
    k, _ = cache.read_pages(pages)
    assert k.abs().sum() > 0, "prefill wrote K/V"
    while request.state is not RequestState.FINISHED:
        core.step()
    assert pool.pending_zero_pages == len(pages), "freed pages wait for zeroing"
    core.step()  # the next step zeroes them first
    k, v = cache.read_pages(pages)
    assert torch.count_nonzero(k) == 0 and torch.count_nonzero(v) == 0
    assert pool.free_pages == pool.num_pages


def test_without_zero_on_free_stale_kv_stays_in_memory(tiny_checkpoint: str) -> None:
    """The control for the above: the hazard zero-on-free removes is real."""
    built = _build(tiny_checkpoint, zero_on_free=False)
    core, cache = built.engine.core, built.kv_cache
    request = _request("r1", "tenant-a", 40, max_tokens=2)
    core.add(request)
    core.step()
    pages = [ref.page_id for ref in request.page_table]
    while request.state is not RequestState.FINISHED:
        core.step()
    k, _ = cache.read_pages(pages)
    assert torch.count_nonzero(k) > 0


def test_random_add_abort_step_keeps_invariants(tiny_checkpoint: str) -> None:
    built = _build(tiny_checkpoint, pool_tokens=192)
    core = built.engine.core
    rng = random.Random(7)
    live: list[Request] = []
    for i in range(60):
        action = rng.random()
        if action < 0.35:
            request = _request(f"r{i}", f"t{i % 3}", rng.randint(1, 60), rng.randint(1, 6))
            core.add(request)
            live.append(request)
        elif action < 0.5 and live:
            core.abort(rng.choice(live).request_id)
        elif core.has_work():
            core.step()
        core.scheduler.check_invariants()
        live = [r for r in live if not r.is_terminal]
    for request in live:
        core.abort(request.request_id)
    while core.has_work():
        core.step()
    core.scheduler.check_invariants()
    assert built.pool.free_pages == built.pool.num_pages


def _run_all(core, requests: list[Request]) -> None:  # type: ignore[no-untyped-def]
    for request in requests:
        core.add(request)
    while core.has_work():
        outcome = core.step()
        assert not outcome.failed
        core.scheduler.check_invariants()


def test_preemption_under_a_full_pool_keeps_every_greedy_answer(tiny_checkpoint: str) -> None:
    """Four requests that each fit the 64-token pool but not together: the engine preempts
    (recomputing prompt + output so far) and every answer equals its unpreempted one (the same
    requests in a pool that holds them all)."""
    lengths = [(20, 20), (12, 28), (25, 15), (8, 24)]

    def run(pool_tokens: int) -> tuple[list[Request], int]:
        built = _build(tiny_checkpoint, pool_tokens=pool_tokens)
        requests = [_request(f"r{i}", f"t{i % 2}", p, m) for i, (p, m) in enumerate(lengths)]
        _run_all(built.engine.core, requests)
        assert built.pool.free_pages == built.pool.num_pages
        assert all(r.state is RequestState.FINISHED for r in requests)
        return requests, built.engine.core.scheduler.num_preemptions

    crowded, preemptions = run(64)
    roomy, none = run(1024)
    assert preemptions >= 2 and none == 0
    assert sum(r.preemptions > 0 for r in crowded) >= 2
    assert [r.output_ids for r in crowded] == [r.output_ids for r in roomy]


def test_prefix_cache_hits_only_within_a_tenant_and_keeps_every_greedy_answer(
    tiny_checkpoint: str,
) -> None:
    """The real model over cached pages: a tenant's second request with the same 60-token system
    prompt reads 48 of its tokens from the cache and answers exactly as with the cache off;
    another tenant with the byte-identical prompt reads none of them."""
    system = [256] + [97 + (i * 7) % 26 for i in range(59)]
    asks = [(system + [120, 121], "tenant-a"), (system + [122], "tenant-a")]
    asks += [(system + [120, 121], "tenant-b"), (system + [123, 124, 125], "tenant-a")]

    def run(prefix_cache: bool) -> tuple[list[list[int]], list[int]]:
        settings = BackendSettings(
            model=tiny_checkpoint,
            pool_tokens=512,
            page_size=16,
            max_batch_tokens=64,
            max_running=8,
            prefix_cache=prefix_cache,
        )
        core = build_engine(settings).engine.core
        outputs, hits = [], []
        for i, (prompt, tenant) in enumerate(asks):
            request = Request(f"r{i}", tenant, prompt, SamplingParams(max_tokens=6, temperature=0))
            cache = core.scheduler.kv.cache
            before = cache.stats.hit_tokens if cache else 0
            _run_all(core, [request])
            hits.append((cache.stats.hit_tokens if cache else 0) - before)
            outputs.append(request.output_ids)
        return outputs, hits

    cached, hits = run(True)
    uncached, none = run(False)
    assert hits == [0, 48, 0, 48] and none == [0, 0, 0, 0]
    assert cached == uncached
