"""The relay benchmark's own parts: the stand-in's shapes, the load generator against a real relay
(the lean floor in front of the stand-in, as processes on 127.0.0.1), the ceiling verdicts, the
report's goals and headlines, and the benchmark page's generated section."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvloop

from bench import relay_report
from bench.bench_relay import Bench, parse_args, prompt_of
from bench.relay_load import (
    Driver,
    Samples,
    Workload,
    chat_request,
    cpu_between,
    cpu_snapshot,
    load_snapshot,
)
from bench.relay_report import Max, Outcome, goals, growth_table, main_table
from bench.relay_standin import MODEL, answer_tokens, build_answer, usage
from bench.relay_systems import gateway_env
from bench.summary import parse
from kvguard.localservices import free_port


def _event(answer_piece: bytes, rid: bytes = b"chatcmpl-1") -> dict[str, object]:
    loaded = json.loads(b'{"id":"' + rid + b'"' + answer_piece)
    assert isinstance(loaded, dict)
    return loaded


def test_stand_in_streams_vllm_chunks_role_first_then_one_token_each_finish_on_the_last() -> None:
    answer = build_answer(chat=True, count=3, created=7)
    events = [_event(piece) for piece in answer.events]
    assert len(events) == 4  # role chunk + 3 tokens; usage and [DONE] follow
    assert events[0]["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    texts = [e["choices"][0]["delta"]["content"] for e in events[1:]]  # type: ignore[index]
    assert texts == answer_tokens(3)
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, None, "length"]  # type: ignore[index]
    assert events[-1]["choices"][0]["stop_reason"] is None  # type: ignore[index]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    final = json.loads(b'{"id":"x"' + answer.usage_event + usage(12, 3) + b"}")
    assert final["choices"] == []
    assert final["usage"] == {"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3}
    body = json.loads(b'{"id":"x"' + answer.body + usage(12, 3) + b"}")
    assert body["choices"][0]["message"]["content"] == "".join(answer_tokens(3))


@contextmanager
def _behind_standin(relay: list[str], ready: str) -> Iterator[tuple[int, int, int]]:
    """The stand-in and a relay in front of it (``python -m`` ``relay`` with ``--port`` and
    ``--upstream``) as real processes, once both answer (the relay at its path ``ready``):
    (stand-in port, relay port, relay pid)."""
    standin_port, relay_port = free_port(), free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.relay_standin", "--port", str(standin_port)]
            + ["--interval-ms", "2"]
        ),
        subprocess.Popen(
            [sys.executable, "-m", *relay, "--port", str(relay_port)]
            + ["--upstream", f"http://127.0.0.1:{standin_port}"]
        ),
    ]
    try:
        deadline = time.monotonic() + 60
        for url in (
            f"http://127.0.0.1:{standin_port}/health",
            f"http://127.0.0.1:{relay_port}{ready}",
        ):
            while True:
                try:
                    httpx.get(url, timeout=1)
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, f"{url} never answered"
                    time.sleep(0.05)
        yield standin_port, relay_port, procs[1].pid
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def lean_relay() -> Iterator[tuple[int, int, int]]:
    """(stand-in port, lean floor port, lean floor pid): real processes."""
    with _behind_standin(["bench.relay_floors", "lean"], "/health") as found:
        yield found


def test_load_generator_counts_every_streamed_event_and_the_relay_cpu(
    lean_relay: tuple[int, int, int],
) -> None:
    _, port, pid = lean_relay

    async def go() -> tuple[Samples, Samples]:
        driver = Driver("127.0.0.1", port)
        host = f"127.0.0.1:{port}"
        stream = chat_request(host, model=MODEL, key=None, content="hi", tokens=4, stream=True)
        plain = chat_request(host, model=MODEL, key=None, content="hi", tokens=4, stream=False)
        streamed = await driver.run(
            Workload((stream,), True, 4, 0.002), rate=50, seconds=0.4, cpu_pids=[pid], load_pids=[]
        )
        answered = await driver.run(
            Workload((plain,), False, 4), rate=100, seconds=0.3, cpu_pids=[pid], load_pids=[]
        )
        return streamed, answered

    streamed, answered = uvloop.run(go())
    assert (streamed.sent, streamed.ok, streamed.errors) == (20, 20, 0)
    assert streamed.events == 20 * 6  # role + 4 tokens + [DONE] (no usage asked for)
    assert len(streamed.ttfts_ms) == 20
    assert (answered.sent, answered.ok, answered.errors) == (30, 30, 0)
    assert streamed.cpu_s is not None and streamed.cpu_s > 0


def test_the_checks_off_pump_relays_whole_answers_and_streams() -> None:
    """The floor the gateway's checks come on top of (``kvguard pump, checks off``: the gateway's
    server protocol, engine client, pump and replies with no check) answers every request: a row
    of errors would make its floor, and the per-event floor argument, a number of nothing."""
    pump = ["bench.relay_candidates", "serve", "pump-no-checks"]
    with _behind_standin(pump, "/") as (_, pump_port, _):

        async def go() -> tuple[Samples, Samples]:
            driver = Driver("127.0.0.1", pump_port)
            host = f"127.0.0.1:{pump_port}"
            plain = chat_request(host, model=MODEL, key=None, content="hi", tokens=4, stream=False)
            stream = chat_request(host, model=MODEL, key=None, content="hi", tokens=4, stream=True)
            answered = await driver.run(
                Workload((plain,), False, 4), rate=50, seconds=0.4, cpu_pids=[], load_pids=[]
            )
            streamed = await driver.run(
                Workload((stream,), True, 4, 0.002), rate=50, seconds=0.4, cpu_pids=[], load_pids=[]
            )
            return answered, streamed

        answered, streamed = uvloop.run(go())
    assert (answered.sent, answered.ok, answered.errors) == (20, 20, 0)
    assert (streamed.sent, streamed.ok, streamed.errors) == (20, 20, 0)
    assert streamed.events == 20 * 6  # role + 4 tokens + [DONE]


def test_an_answer_that_never_ends_is_an_error_not_a_hang() -> None:
    silent = free_port()
    listener = socket.socket()
    listener.bind(("127.0.0.1", silent))
    listener.listen(8)  # accepts, never answers
    try:

        async def go() -> Samples:
            request = chat_request(
                f"127.0.0.1:{silent}", model=MODEL, key=None, content="x", tokens=1, stream=False
            )
            return await Driver("127.0.0.1", silent).run(
                Workload((request,), False, 1),
                rate=10,
                seconds=0.2,
                cpu_pids=[],
                load_pids=[],
                timeout_s=0.5,
            )

        samples = uvloop.run(go())
    finally:
        listener.close()
    assert (samples.ok, samples.errors) == (0, 2)


def test_cpu_between_counts_a_thread_born_in_the_window_from_zero() -> None:
    before = {(1, 1): 5_000_000_000}
    after = {(1, 1): 5_500_000_000, (1, 2): 250_000_000}
    assert cpu_between(before, after) == pytest.approx(0.75)
    assert cpu_snapshot([1 << 22]) == {}  # no such process: nothing, no error


def test_the_load_side_counts_this_process_not_the_relays_it_started() -> None:
    """The generator's process starts the relays it measures: their CPU is not the load side's
    (it used to be, and every ceiling of a relay near its limit read as bounded by the load)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        child = {busy.pid}

        def child_cpu(snapshot: dict[tuple[int, int], int]) -> int:
            return sum(ns for (pid, _), ns in snapshot.items() if pid in child)

        before = cpu_snapshot([os.getpid()])
        deadline = time.monotonic() + 30
        while child_cpu(cpu_snapshot([os.getpid()])) - child_cpu(before) < 200_000_000:
            assert time.monotonic() < deadline, "the child never ran"
            time.sleep(0.01)  # polling for the child's CPU to grow, bounded by the deadline
        assert child_cpu(cpu_snapshot([os.getpid()])) > 0  # descendants: the child counts
        assert child_cpu(load_snapshot([])) == 0  # the load side: this process alone
        assert (os.getpid(), os.getpid()) in load_snapshot([])
    finally:
        busy.kill()
        busy.wait()


def _samples(
    p99_ms: float,
    *,
    lag_ms: float = 0.1,
    errors: int = 0,
    busy: float = 0.1,
    relay_busy: float | None = 0.5,
) -> Samples:
    return Samples(
        sent=100,
        ok=100 - errors,
        errors=errors,
        latencies_ms=[p99_ms] * 100,
        lag_ms=[lag_ms] * 100,
        wall_s=1.0,
        cpu_s=relay_busy,
        load_cpu_s=busy,
    )


def test_ceiling_verdicts_tell_the_relay_missing_the_bound_from_the_load_side_running_out() -> None:
    assert Bench.judge(_samples(10)) == "ok"
    assert Bench.judge(_samples(60)) == "over"
    assert Bench.judge(_samples(10, errors=1)) == "over"
    assert Bench.judge(_samples(10, lag_ms=60, busy=0.6)) == "load"
    assert Bench.judge(_samples(10, busy=0.95)) == "load"
    # sending late while the load side is not busy: other work on the machine, judged normally
    assert Bench.judge(_samples(10, lag_ms=60, busy=0.2)) == "ok"


def test_a_relay_whose_own_core_is_full_is_its_own_limit_whatever_the_load_side_does() -> None:
    """A relay using its whole core has reached its ceiling even when the load side is busy too
    (LiteLLM's proxy at ~1,300 events/s, where the generator also lags): the rate is judged by the
    bound, so its maximum is a measured value, not a lower bound."""
    full = 0.95
    assert Bench.judge(_samples(60, lag_ms=60, busy=0.6, relay_busy=full)) == "over"
    assert Bench.judge(_samples(10, busy=0.95, relay_busy=full)) == "ok"
    assert Bench.judge(_samples(10, busy=0.95, relay_busy=0.5)) == "load"
    assert Bench.judge(_samples(10, busy=0.95, relay_busy=None)) == "load"  # the direct path


def _outcomes(
    event_us: float,
    added_p99: float,
    tenants_growth: float,
    litellm_max: Max | None = None,
    last_event_p99: float = 3.0,
    request_us: float = 800.0,
) -> list[Outcome]:
    gateway = Outcome(
        "kvguard gateway",
        request_us=[request_us, request_us + 50, request_us + 20],
        event_us=[event_us, event_us, event_us],
        max_requests=Max(900),
        max_events=Max(80_000),
        added={100: (0.5, 1.0, 0), 500: (0.6, added_p99, 0)},
        growth={"10 tenants": [800.0], "10,000 tenants": [800.0 * (1 + tenants_growth)]},
        event_delay_ms=[(1.0, last_event_p99), (2.0, last_event_p99 + 4), (1.5, last_event_p99)],
    )
    proxy = Outcome("LiteLLM proxy", [4000], [700], max_requests=Max(200), max_events=Max(5000))
    if litellm_max is not None:
        proxy.max_events = litellm_max
    # the pass-through of the same rounds: the ratios are taken round by round
    floor = Outcome("aiohttp pass-through", [500, 520, 510], [50, 52, 51], max_events=Max(40_000))
    return [floor, gateway, proxy]


def test_goals_are_met_only_when_every_one_holds_and_headlines_reach_bench_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    good = {o.name: o for o in _outcomes(45.0, 4.0, 0.05)}
    text, met = goals(good, 10_000)
    assert met, text
    headlines = parse(capsys.readouterr().out)
    assert {h.measure for h in headlines if h.met} >= {
        "kvguard CPU per streamed event / the aiohttp pass-through's, same round",
        "kvguard CPU per non-streaming request / the aiohttp pass-through's, same round",
        "max streamed events/s on one core, kvguard / LiteLLM proxy",
        "gateway-added p99 at 500/s non-streaming",
    }
    assert "| 0.88 (0.87-0.90)x | met |" in text  # 45 µs over 50, 52 and 51: round by round
    late = _outcomes(45.0, 4.0, 0.05, last_event_p99=12.0)  # later than one event interval
    for bad in (
        _outcomes(55.0, 4.0, 0.05),  # 1.1x the pass-through's CPU per event
        _outcomes(45.0, 4.0, 0.05, request_us=1100.0),  # 2.2x per request
        _outcomes(45.0, 6.0, 0.05),
        _outcomes(45.0, 4.0, 0.05, Max(6000)),  # 13x LiteLLM's events/s
        late,
    ):
        assert not goals({o.name: o for o in bad}, 10_000)[1]
    assert goals({o.name: o for o in _outcomes(45, 4, 0.5)}, 10_000)[1]  # issue 23's: shown
    # the same pump with every check off is shown beside a ratio (the floor of a miss)
    off = Outcome("kvguard pump, checks off", [300, 312, 306], [30, 31.2, 30.6])
    text, _ = goals({**good, off.name: off}, 10_000)
    assert "0.88 (0.87-0.90)x; the same pump, every check off: 0.60 (0.60-0.60)x" in text


def test_a_ratio_to_a_lower_bound_decides_the_litellm_goal_only_where_it_can(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def verdict(theirs: Max) -> bool | None:
        goals({o.name: o for o in _outcomes(45.0, 4.0, 0.05, theirs)}, 10_000)
        found = [h for h in parse(capsys.readouterr().out) if "LiteLLM" in h.measure]
        return found[0].met

    assert verdict(Max(5000)) is True  # 80,000 / 5,000 = 16x
    assert verdict(Max(7000)) is False  # 11.4x
    assert verdict(Max(5000, bounded_by_load=True)) is None  # LiteLLM could do more: undecided
    assert verdict(Max(7000, bounded_by_load=True)) is False  # at most 11.4x
    assert verdict(Max(0.0, below=67)) is True  # LiteLLM missed the bound at its lowest rate


def test_tables_show_medians_with_their_spread_and_growth_against_the_first_row() -> None:
    outcomes = _outcomes(35.0, 4.0, 0.25)
    outcomes[0].max_events = Max(40_000, bounded_by_load=True)
    table = main_table(outcomes, (100, 500, 1000))
    # the last event's added delay: medians over rounds of p50 and of p99
    assert (
        "| kvguard gateway | 820 (800-850) | 35.0 (35.0-35.0) | 900 | 80,000 | 1.50 / 3.00 |"
        in table
    )
    assert "| >= 40,000 |" in table  # the load side ran out first
    assert "not reached" in table  # the gateway was not run at 1,000/s
    growth = growth_table(outcomes)
    assert "| kvguard gateway | 10,000 tenants | 1,000 | +25% |" in growth


def test_quick_mode_is_shorter_and_prompts_have_the_asked_size() -> None:
    quick, full = parse_args(["--quick"]), parse_args([])
    assert quick.rounds < full.rounds and quick.cost_seconds < full.cost_seconds
    assert len(prompt_of(100_000)) == 100_000
    with pytest.raises(SystemExit):
        parse_args(["--tenants", "5"])


def test_the_benchmark_page_holds_the_generated_section() -> None:
    page = relay_report.page()
    assert relay_report.section() in page.read_text(encoding="utf-8"), (
        "stale: run python -m bench.relay_report"
    )


def test_update_rewrites_only_the_marked_section(tmp_path: Path) -> None:
    target = tmp_path / "page.md"
    target.write_text(f"# page\n\n{relay_report.BEGIN}\nold\n{relay_report.END}\n\nafter\n")
    assert relay_report.update(target)
    text = target.read_text()
    assert text.startswith("# page\n\n") and text.endswith("\n\nafter\n")
    assert relay_report.section() in text and "old" not in text
    assert not relay_report.update(target)  # already current


def test_report_names_the_command_machine_load_and_workload() -> None:
    args = argparse.Namespace(
        tenants=10_000, cost_rate=100.0, stream_rate=20.0, rounds=3, canary_rate=0.1, prompt_rate=50
    )
    text, _ = relay_report.report(
        args,
        _outcomes(35.0, 4.0, 0.05),
        load=((1.0, 2.0, 3.0), (1.5, 2.0, 3.0)),
        missing_litellm=None,
        argv=["--quick"],
    )
    assert "`python -m bench.bench_relay --quick` at commit" in text
    assert "before: 1.0 / 2.0 / 3.0; after: 1.5 / 2.0 / 3.0" in text
    assert "64-token answers (67 SSE events, one every 10 ms)" in text


def test_the_benchmarked_gateway_settings_pass_production_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway under test runs in production mode: every secret it needs is set, strong."""
    from canary.config import CanarySettings
    from gateway.config import GatewaySettings

    env = gateway_env("redis://127.0.0.1:1/0", "postgresql+psycopg://postgres@127.0.0.1:1/x")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = GatewaySettings()
    assert settings.mode.value == "production" and settings.redis_url
    assert CanarySettings().canary_enabled


def test_ab_tables_give_each_version_its_per_round_ratio_to_the_floor() -> None:
    from bench.relay_ab import tables

    found = {
        "A": {"request": [2000.0, 1800.0, 1900.0], "event": [100.0, 90.0, 95.0]},
        "B": {"request": [1000.0, 1800.0, 1710.0], "event": [50.0, 90.0, 95.0]},
        "aiohttp pass-through": {"request": [500.0, 600.0, 450.0], "event": [50.0, 45.0, 50.0]},
    }
    text = tables(found)
    # B / A per round: 0.5, 1.0, 0.9 -> median 0.9
    assert "| µs per request | 1,900 (1,800-2,000) | 1,710 (1,000-1,800) | 0.900 |" in text
    # per round / floor: A 4.0, 3.0, 4.22; B 2.0, 3.0, 3.8
    assert "| per request | 500 (450-600) µs | 4.00 (3.00-4.22)x | 3.00 (2.00-3.80)x |" in text
    assert "| per event | 50.0 (45.0-50.0) µs | 2.00 (1.90-2.00)x | 1.90 (1.00-2.00)x |" in text
    assert "pass-through" not in tables({k: found[k] for k in "AB"})


def test_slope_tables_split_a_stream_into_its_events_and_the_rest() -> None:
    from bench.relay_slope import IDLE, Case, tables

    cases = [Case.of("s:1:10"), Case.of("s:65:10"), Case.of("p:1:100")]
    found = {
        "gw": {IDLE: [3.0, 2.0, 4.0], "s:1:10": [3000.0, 3100.0, 2900.0]},
        "floor": {IDLE: [0.0, 0.0, 0.0], "s:1:10": [800.0, 800.0, 800.0]},
    }
    found["gw"]["s:65:10"] = [5200.0, 5100.0, 5000.0]
    found["floor"]["s:65:10"] = [2400.0, 2400.0, 2400.0]
    found["gw"]["p:1:100"] = found["floor"]["p:1:100"] = [1000.0]
    text = tables(found, cases)
    assert (
        "| gw | 3 (2-4) | 3,000 (2,900-3,100) | 5,100 (5,000-5,200) | 1,000 (1,000-1,000) |" in text
    )
    # (5100 - 3000) / 64 = 32.8 µs per event; 3000 - 32.8 x 4 events = 2,869 besides them
    assert "| gw | s:1:10 vs s:65:10 | 32.8 | 2,869 |" in text
    assert "| floor | s:1:10 vs s:65:10 | 25.0 | 700 |" in text
    assert "p:1:100 vs" not in text  # only streamed cases at one rate pair up


def test_the_tail_table_gives_each_phase_and_checkout_its_median_and_range() -> None:
    from bench.relay_tail import Round, table

    found = {
        ("fresh", "base"): [Round(5.0, 4.6, 1070.0, 0), Round(5.2, 4.9, 1127.0, 0)],
        ("after a burst", "base"): [Round(9.4, 9.1, 1097.0, 1), Round(6.0, 5.6, 1068.0, 0)],
    }
    lines = table(found).splitlines()
    assert lines[2] == (
        "| fresh | base | 5.10 [5.00..5.20] | 4.75 [4.60..4.90] "
        "| 1,098.50 [1,070.00..1,127.00] | 0 |"
    )
    assert lines[3].startswith("| after a burst | base | 7.70 [6.00..9.40] | 7.35 [5.60..9.10] ")
    assert lines[3].endswith("| 1 |")
