"""``bench.bench_loop_stalls``: each request case reaches the gateway's answer the table reports,
so the benchmark times the refusal the gateway really gives (not a case that stopped elsewhere)."""

from __future__ import annotations

from bench.bench_loop_stalls import MAX_BODY, REQUESTS, _door

EXPECTED = {
    "ordinary prose (the baseline)": "to the engine",
    "`CNRY-` + 32 guessed characters, repeated": "400 too_many_canary_prefixes",
    "one text part per item of `content`": "400 (schema)",
    "`response_format` holding millions of numbers": "400 (schema)",
    "`response_format` holding millions of empty lists": "400 (schema)",
    "more distinct non-BMP characters than the old fold cache held": "to the engine",
    "Cyrillic prose (after the row above)": "to the engine",
    "JSON nested 1,000 deep in `response_format`": "400 (schema)",
}


def test_each_request_case_is_answered_as_the_table_says() -> None:
    assert set(REQUESTS) == set(EXPECTED)
    for name, build in REQUESTS.items():
        raw = build()
        assert MAX_BODY - 64 <= len(raw) <= MAX_BODY or "nested" in name, (name, len(raw))
        assert _door(raw) == EXPECTED[name], name
