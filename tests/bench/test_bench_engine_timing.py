"""The benchmark's bookkeeping: closed-loop timelines of the transformers baselines, summaries."""

from __future__ import annotations

import pytest

from bench.engine_common import Trace, WorkloadSpec, make_workload, summarize
from bench.engine_hf import _Served, serial_closed_loop


def _served(began: float, times: list[float]) -> _Served:
    return _Served(began, tuple(times), tuple(range(len(times))))


def test_serial_server_queues_the_closed_loop_clients():
    # server timeline (seconds since start): r0 0-2, r1 2-3, r2 3-6, r3 6-7
    served = [
        _served(100.0, [101.0, 102.0]),
        _served(102.0, [102.5, 103.0]),
        _served(103.0, [104.0, 105.0, 106.0]),
        _served(106.0, [107.0]),
    ]
    traces = serial_closed_loop(100.0, served, concurrency=2)
    # clients 0 and 1 send r0, r1 at 0; r2 when r0 is done (2), r3 when r1 is done (3)
    assert [t.sent for t in traces] == [0.0, 0.0, 2.0, 3.0]
    assert [t.first_token - t.sent for t in traces] == [1.0, 2.5, 2.0, 4.0]
    summary = summarize("s", 2, traces)
    assert (summary.tokens, summary.wall_s) == (8, 7.0)
    assert summary.ttft_p50_ms == pytest.approx(2250.0)
    # per-token latency of the requests with > 1 token: 1.0, 0.5, 1.0
    assert summary.tpot_p50_ms == pytest.approx(1000.0)


def test_served_record_stops_at_max_tokens_and_at_eos():
    steps = [(1.0, [5, 7]), (2.0, [257, 8]), (3.0, [9, 9])]
    assert _Served.from_steps(0.0, steps, 0, 3).token_ids == (5, 257)  # EOS ends it
    assert _Served.from_steps(0.0, steps, 1, 2).token_ids == (7, 8)  # its own max_tokens


def test_workload_is_seeded_and_within_its_ranges():
    spec = WorkloadSpec(requests=50, prompt_range=(8, 64), output_range=(4, 16), seed=3)
    a, b = make_workload(spec), make_workload(spec)
    assert a == b
    assert all(8 <= len(a.prompt_ids(i)) <= 64 for i in range(50))
    assert all(4 <= m <= 16 for m in a.max_tokens)
    assert all(a.prompt_ids(i)[0] == 256 for i in range(50))
    trace = Trace(sent=0.0)
    trace.record(1.0, 5)
    assert (trace.first_token, trace.last_token, trace.tokens) == (1.0, 1.0, 1)
