"""The load run's per-response checks (``kvguard.load.content``), exactly: each broken expectation
becomes a failure with a reason, and a correct answer passes."""

from __future__ import annotations

import json

from canary.markers import MarkerCodec, MarkerKeyring
from kvguard.load.content import (
    Expected,
    FailureKind,
    SseLines,
    StreamedAnswer,
    check_answer,
    foreign_markers,
    read_sse_line,
)

CODEC = MarkerCodec(MarkerKeyring({1: b"load-content-test-key-0123456789abcdef"}, current=1))
OWN = CODEC.issue("tn_a").text
FOREIGN = CODEC.issue("tn_b").text


def _expected(**overrides: object) -> Expected:
    fields: dict = {"status": 200, "marker": OWN, "max_tokens": 45, "prompt_tokens": 133}
    fields.update(byte_tokens=True)
    fields.update(overrides)
    return Expected(**fields)


def _answer(
    text: str, *, completion: int | None = None, prompt: int = 133, **extra: object
) -> StreamedAnswer:
    completion = len(text.encode()) + 1 if completion is None else completion
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    usage["total_tokens"] = prompt + completion
    fields: dict = {"status": 200, "text": text, "usage": usage, "finish_reason": "stop"}
    fields["done"] = True
    fields.update(extra)
    return StreamedAnswer(**fields)


def test_own_marker_back_with_consistent_usage_passes() -> None:
    verdict = check_answer(_expected(), _answer(OWN))
    assert verdict.ok and verdict.failures == ()


def test_missing_own_marker_is_a_content_failure() -> None:
    verdict = check_answer(_expected(), _answer("The harbor report lists"))
    assert verdict.failures == ((FailureKind.CONTENT, "own marker missing"),)


def test_a_foreign_marker_fails_even_next_to_the_own_one() -> None:
    verdict = check_answer(_expected(max_tokens=80), _answer(f"{OWN} {FOREIGN}"))
    assert verdict.failures == ((FailureKind.CONTENT, "1 foreign marker(s) in the answer"),)
    assert FOREIGN not in verdict.reason() and OWN not in verdict.reason()  # no secrets in reasons


def test_a_cut_off_foreign_marker_is_a_leak_a_cut_off_own_one_is_not() -> None:
    cut = FOREIGN[:12]  # "CNRY-" and 7 characters of another tenant's marker
    verdict = check_answer(_expected(max_tokens=80), _answer(f"{OWN} {cut}"))
    assert verdict.failures == ((FailureKind.CONTENT, "1 foreign marker(s) in the answer"),)
    assert check_answer(_expected(max_tokens=80), _answer(f"{OWN} {OWN[:20]}")).ok
    assert foreign_markers(f"{OWN} {cut} {FOREIGN[:-1]} CNRY-AB", OWN) == 2  # "CNRY-AB": too short


def test_a_damaged_copy_is_not_the_own_marker() -> None:
    damaged = OWN[:-1] + ("A" if OWN[-1] != "A" else "B")
    verdict = check_answer(_expected(), _answer(damaged))
    assert verdict.kinds == {FailureKind.CONTENT}
    assert [r for _, r in verdict.failures] == [
        "own marker missing",
        "1 foreign marker(s) in the answer",
    ]


def test_usage_that_disagrees_with_the_stream_fails() -> None:
    cases = {
        "usage.completion_tokens 10 for 37 streamed bytes": _answer(OWN, completion=10),
        "usage.completion_tokens 50 > max_tokens 45": _answer(OWN, completion=50),
        "usage.prompt_tokens 140, sent 133": _answer(OWN, prompt=140),
        "usage.prompt_tokens 0 <= 0": _answer(OWN, prompt=0),
        "no usage in the stream": _answer(OWN, usage=None),
        "finish_reason length at 38 of max_tokens 45": _answer(OWN, finish_reason="length"),
    }
    for reason, answer in cases.items():
        assert check_answer(_expected(), answer).failures == ((FailureKind.CONTENT, reason),)
    # A tokenizer that is not byte-level: only the general rules apply, within the slack.
    loose = _expected(byte_tokens=False, prompt_slack=2)
    assert check_answer(loose, _answer(OWN, completion=10, prompt=135)).ok
    assert not check_answer(loose, _answer(OWN, completion=10, prompt=136)).ok


def test_status_and_stream_errors() -> None:
    over = _expected(status=400, code="context_length_exceeded")
    assert check_answer(over, StreamedAnswer(status=400, code="context_length_exceeded")).ok
    served = check_answer(over, _answer(OWN))
    assert served.failures == (
        (FailureKind.STATUS, "expected 400 context_length_exceeded, got 200"),
    )
    limited = check_answer(_expected(), StreamedAnswer(status=429, code="rate_limit_exceeded"))
    assert limited.kinds == {FailureKind.STATUS}
    cut = _answer(OWN[:20], stream_errors=["isolation_violation"], done=False)
    reasons = [r for _, r in check_answer(_expected(), cut).failures]
    assert reasons[0] == "stream ended with error event isolation_violation"
    assert reasons[1] == "own marker missing"
    unfinished = check_answer(_expected(), _answer(OWN, done=False))
    assert unfinished.failures == ((FailureKind.CONTENT, "stream ended without [DONE]"),)


def test_sse_reading_across_arbitrary_chunk_splits() -> None:
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": OWN[:20]}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": OWN[20:] + " é"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 133, "completion_tokens": 41}},
    ]
    raw = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events)
    raw_bytes = (raw + "data: [DONE]\n\n").encode()
    for size in (1, 7, len(raw_bytes)):
        lines, answer, grew = SseLines(), StreamedAnswer(status=200), 0
        for i in range(0, len(raw_bytes), size):
            for line in lines.feed(raw_bytes[i : i + size]):
                grew += read_sse_line(answer, line)
        assert (answer.text, answer.content_chunks, grew) == (OWN + " é", 2, 2)
        assert answer.done and answer.finish_reason == "stop"
        assert answer.usage == {"prompt_tokens": 133, "completion_tokens": 41}
    error = StreamedAnswer(status=200)
    read_sse_line(error, 'data: {"error": {"code": "isolation_violation", "message": "cut"}}')
    assert error.stream_errors == ["isolation_violation"]
