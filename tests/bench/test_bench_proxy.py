"""bench.bench_proxy bookkeeping: arguments, added latency over direct, the LiteLLM proxy config."""

from __future__ import annotations

import pytest

from bench.bench_proxy import Samples, added, headlines, merge, parse_args, table
from bench.litellm_proxy import PROXY_KEY, PROXY_MODEL, proxy_config
from bench.summary import parse


def test_quick_is_one_goal_rate_with_short_rounds_and_explicit_flags_are_kept() -> None:
    quick = parse_args(["--quick"])
    assert (quick.rates, quick.seconds, quick.rounds) == ([20, 100], 10.0, 2)
    custom = parse_args(["--rates", "10", "30", "--seconds", "3", "--modes", "streaming"])
    assert (custom.rates, custom.seconds, custom.modes) == ([10, 30], 3.0, ["streaming"])


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--rates", "0"], ["--seconds", "-1"]])
def test_non_positive_load_is_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(bad)


def test_added_latency_is_the_path_percentile_minus_direct_at_the_same_mode_and_rate() -> None:
    direct = Samples(latencies_ms=[float(x) for x in range(1, 101)], wall_s=2.0)  # 1..100 ms
    gateway = Samples(latencies_ms=[float(x) + 3 for x in range(1, 101)], wall_s=2.0)
    other_rate = Samples(latencies_ms=[1000.0], wall_s=1.0)  # 1 answer/s offered 100/s
    results = {
        ("streaming", "direct", 50): direct,
        ("streaming", "gateway", 50): gateway,
        ("streaming", "direct", 100): other_rate,
    }
    assert added(results, ("streaming", "gateway", 50), 0.5) == pytest.approx(3.0)
    assert added(results, ("streaming", "gateway", 50), 0.99) == pytest.approx(3.0)
    text = table(results)
    assert "| streaming | gateway | 50 | 50 | 100 | 0 |" in text  # achieved 100 answers in 2 s
    saturated = text.split("saturated", 1)[1]
    assert "streaming direct at 100/s" in saturated and "at 50/s" not in saturated


def test_rounds_merge_into_one_sample_set() -> None:
    total = Samples()
    merge(total, Samples(latencies_ms=[1.0], ttfts_ms=[0.5], sent=2, errors=1, cpu_s=0.25))
    merge(total, Samples(latencies_ms=[2.0], ttfts_ms=[0.7], sent=1, errors=0, cpu_s=0.5))
    assert (total.latencies_ms, total.ttfts_ms) == ([1.0, 2.0], [0.5, 0.7])
    assert (total.sent, total.errors, total.cpu_s) == (3, 1, 0.75)


def test_proxy_config_serves_the_engine_behind_a_master_key_under_a_safe_model_name() -> None:
    text = proxy_config("http://127.0.0.1:8100", "kvguard-tiny")
    assert "api_base: http://127.0.0.1:8100/v1" in text
    assert "model: openai/kvguard-tiny" in text
    assert f"master_key: {PROXY_KEY}" in text
    assert "llama" not in PROXY_MODEL.lower()  # litellm's token counter stalls on such names


def _load(latency_ms: float, answered: int, wall_s: float) -> Samples:
    return Samples(latencies_ms=[latency_ms] * answered, sent=answered, wall_s=wall_s)


def test_goals_are_judged_only_where_the_engine_kept_up_with_the_offered_rate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    kept_up = {  # 100 answers/s at 100/s offered: the goal is judged (gateway adds 3 ms)
        ("non-streaming", "direct", 100): _load(10.0, 100, 1.0),
        ("non-streaming", "gateway", 100): _load(13.0, 100, 1.0),
        ("non-streaming", "litellm proxy", 100): _load(20.0, 100, 1.0),
    }
    assert headlines(kept_up, [100], ["non-streaming"]) is True
    judged = parse(capsys.readouterr().out)
    assert [h.met for h in judged] == [True, True]
    assert judged[0].value == "3.00 ms"

    saturated = {**kept_up, ("non-streaming", "direct", 100): _load(10.0, 60, 1.0)}
    saturated[("non-streaming", "gateway", 100)] = _load(9000.0, 100, 1.0)
    assert headlines(saturated, [100], ["non-streaming"]) is True  # not judged, not missed
    unjudged = parse(capsys.readouterr().out)
    assert [h.met for h in unjudged] == [None, None]
    assert "saturated" in unjudged[0].value and "saturated" in unjudged[1].measure


def test_a_goal_is_not_judged_on_a_negative_added_latency(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A direct path that stalled (its p99 339 ms at 100/s while the gateway's was 55 ms, in a
    full run on a busy machine) makes the gateway's "added" p99 negative: nothing was measured
    about the gateway there, so neither goal is judged (it was reported met at -284 ms)."""
    stalled = {
        ("non-streaming", "direct", 100): _load(339.0, 100, 1.0),
        ("non-streaming", "gateway", 100): _load(55.0, 100, 1.0),
        ("non-streaming", "litellm proxy", 100): _load(4000.0, 100, 1.0),
    }
    assert headlines(stalled, [100], ["non-streaming"]) is True  # not judged, not missed
    unjudged = parse(capsys.readouterr().out)
    assert [h.met for h in unjudged] == [None, None]
    assert "stalled" in unjudged[0].value and "stalled" in unjudged[1].measure
