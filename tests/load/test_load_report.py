"""The load summary's arithmetic (``kvguard.load.report``), on hand-made samples with known
answers, and the duration syntax of ``kvguard load --duration``."""

from __future__ import annotations

import pytest

from kvguard.load.report import (
    Sample,
    Slo,
    format_summary,
    passed,
    percentile,
    progress_line,
    summarize,
)
from kvguard.load.runner import parse_duration


def test_percentiles_interpolate_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def _ok(size: str, ttft: float, e2e: float, tokens: int, itl: tuple[float, ...] = ()) -> Sample:
    return Sample(size, 0, 200, None, e2e, ttft, itl, 100, tokens)


def test_summary_counts_rates_goodput_and_failures() -> None:
    samples = [
        _ok("short", 100.0, 1100.0, 11, (10.0, 30.0)),
        _ok("short", 300.0, 1300.0, 11),
        _ok("near", 500.0, 2500.0, 21),
        Sample("near", 1, 200, None, 900.0, 400.0, (), 100, 11, ("content",), ("content: x",)),
        Sample("over", 0, 400, "context_length_exceeded", 20.0),
        Sample("over", 1, 200, None, 50.0, 10.0, (), 100, 5, ("status",), ("status: y",)),
    ]
    sizes = [{"name": "short", "total_tokens": 145}, {"name": "near", "total_tokens": 512}]
    summary = summarize(samples, wall_s=2.0, slo=Slo(ttft_ms=350.0), sizes=sizes)
    assert summary["requests"] == 6 and summary["requests_per_s"] == 3.0
    assert summary["content_check_failures"] == 1 and summary["unexpected_statuses"] == 1
    assert summary["failure_reasons"] == {"content: x": 1, "status: y": 1}
    # Good: the two short 200s within the TTFT SLO (the near one took 500 ms, two failed).
    assert summary["good_requests"] == 2 and summary["goodput_requests_per_s"] == 1.0
    assert summary["output_tokens"] == 11 + 11 + 21 + 11 + 5
    assert summary["output_tokens_per_s"] == 29.5
    assert summary["ttft_ms"]["p50"] == 300.0  # the 200 answers: 10, 100, 300, 400, 500
    assert summary["itl_ms"] == {"p50": 20.0, "p90": 28.0, "p99": 29.8, "mean": 20.0, "count": 2}
    assert summary["tpot_ms"]["p50"] == 100.0  # (1100 - 100) / 10, (1300 - 300) / 10, ...
    assert summary["by_size"]["short"]["statuses"] == {"200": 2}
    assert summary["by_size"]["near"]["failures"] == 1
    assert not passed(summary)
    assert format_summary(summary).splitlines()[-1] == "FAIL"
    clean = summarize(samples[:3] + samples[4:5], wall_s=1.0)
    assert passed(clean) and clean["good_requests"] == 3
    assert not passed(summarize([], wall_s=1.0))  # a run that sent nothing proves nothing
    # A request still running at the stop timeout was never checked: the run fails.
    cut_off = {**clean, "requests_unfinished": 1}
    assert not passed(cut_off)
    assert format_summary(cut_off).splitlines()[-2:] == [
        "requests still running at the stop timeout (unchecked): 1",
        "FAIL",
    ]


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90", "30s", "2m", "1m30s", "1h", "0.5s")] == [
        90.0,
        30.0,
        120.0,
        90.0,
        3600.0,
        0.5,
    ]
    for bad in ("", "s", "10x", "0s", "-3s"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_progress_line_counts_failures_and_content_failures_apart() -> None:
    samples = [
        Sample("short", 0, 200, None, 10.0),
        Sample("near", 1, 200, None, 10.0, failure_kinds=("content",)),
        Sample("over", 0, 200, None, 10.0, failure_kinds=("status",)),
        Sample("over", 1, 200, None, 10.0, failure_kinds=("content", "status")),
    ]
    line = progress_line(samples, elapsed_s=2.0, users=3)
    assert line == "[   2.0 s] users 3  requests 4 (2.0/s)  failures 3  content-check failures 2"
