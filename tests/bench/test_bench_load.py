"""``bench.bench_load``'s report: a run where no answer streamed text reports it, never crashes."""

from __future__ import annotations

from bench.bench_load import _ttft


def test_ttft_without_any_first_token_is_reported_not_a_crash() -> None:
    assert _ttft(None, None) == "none: no answer streamed any text"
    assert _ttft(12.4, 30.6) == "12 / 31 ms"
