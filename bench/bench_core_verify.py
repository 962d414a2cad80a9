"""Micro-benchmark of PagePool.verify, the read-path ownership check the runner makes per step.

Prints nanoseconds per page verified for a few batch shapes: the whole batch's page tables
checked once, as the runner does before attention. Pure Python, no torch.

    .venv/bin/python -m bench.bench_core_verify   (from the repo root)
"""

from __future__ import annotations

import time

from backend.core.pages import Owner, PagePool, PageRef
from bench.summary import emit


def build(num_requests: int, pages_each: int) -> tuple[PagePool, list[tuple[list[PageRef], Owner]]]:
    pool = PagePool(num_requests * pages_each, 16, zero_on_free=False)
    tables = []
    for i in range(num_requests):
        owner = Owner(f"req-{i}", f"tenant-{i % 7}")
        tables.append((pool.allocate(pages_each, owner), owner))
    return pool, tables


def ns_per_page(num_requests: int, pages_each: int, *, repeats: int = 7) -> float:
    pool, tables = build(num_requests, pages_each)
    verify = pool.verify
    rounds = max(1, 200_000 // (num_requests * pages_each))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(rounds):
            for refs, owner in tables:
                verify(refs, owner)
        best = min(best, time.perf_counter_ns() - start)
    return best / (rounds * num_requests * pages_each)


def main() -> None:
    print("requests  pages/request  ns/page (best of 7)")
    for num_requests, pages_each in ((1, 8), (8, 64), (64, 16), (64, 256), (256, 4)):
        ns = ns_per_page(num_requests, pages_each)
        print(f"{num_requests:8d}  {pages_each:13d}  {ns:8.1f}")
    emit(
        "ownership",
        f"pool.verify cost per page ({num_requests} x {pages_each} pages)",
        f"{ns:.0f} ns",
    )


if __name__ == "__main__":
    main()
