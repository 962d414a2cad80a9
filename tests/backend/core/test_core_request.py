"""Request lifecycle table, terminal outcomes, sampling validation and redacted reprs."""

from __future__ import annotations

import itertools

import pytest

from backend.core.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    InvalidTransition,
    OutOfPages,
)
from backend.core.request import (
    MIN_SAMPLING_TEMPERATURE,
    TERMINAL,
    TRANSITIONS,
    FinishReason,
    Request,
    RequestState,
    SamplingParams,
)

S = RequestState
ERROR = ContextLengthExceeded(10, 11, 10, 1, "context_window")

EXPECTED_TABLE = {
    S.WAITING: {S.PREFILLING, S.AWAITING_KV, S.REJECTED, S.ABORTED, S.FAILED},
    S.AWAITING_KV: {S.DECODING, S.FINISHED, S.REJECTED, S.ABORTED, S.FAILED},
    S.PREFILLING: {S.DECODING, S.FINISHED, S.PREEMPTED, S.ABORTED, S.FAILED},
    S.DECODING: {S.FINISHED, S.PREEMPTED, S.ABORTED, S.FAILED},
    S.PREEMPTED: {S.PREFILLING, S.ABORTED, S.FAILED},
    S.FINISHED: set(),
    S.REJECTED: set(),
    S.ABORTED: set(),
    S.FAILED: set(),
}

# The legal way into each state from WAITING, and what each legal move needs.
PATH_TO = {
    S.WAITING: [],
    S.AWAITING_KV: [S.AWAITING_KV],
    S.PREFILLING: [S.PREFILLING],
    S.DECODING: [S.PREFILLING, S.DECODING],
    S.PREEMPTED: [S.PREFILLING, S.DECODING, S.PREEMPTED],
    S.FINISHED: [S.PREFILLING, S.DECODING, S.FINISHED],
    S.REJECTED: [S.REJECTED],
    S.ABORTED: [S.ABORTED],
    S.FAILED: [S.FAILED],
}


def make_request(prompt: tuple[int, ...] = (5, 6, 7)) -> Request:
    return Request("req-1", "tenant-a", prompt, SamplingParams(max_tokens=4))


def move(request: Request, to: RequestState) -> None:
    if to is S.FINISHED:
        request.transition(to, finish_reason=FinishReason.LENGTH)
    elif to in (S.REJECTED, S.FAILED):
        request.transition(to, ERROR)
    else:
        request.transition(to)


def request_in(state: RequestState) -> Request:
    request = make_request()
    for step in PATH_TO[state]:
        move(request, step)
    assert request.state is state
    return request


def test_transition_table_and_terminal_set_are_exact() -> None:
    assert dict(TRANSITIONS) == EXPECTED_TABLE
    assert set(S) == set(TRANSITIONS)
    assert frozenset({S.FINISHED, S.REJECTED, S.ABORTED, S.FAILED}) == TERMINAL
    assert all(not TRANSITIONS[state] for state in TERMINAL)


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(S, S)))
def test_every_pair_is_allowed_exactly_when_the_table_says(
    src: RequestState, dst: RequestState
) -> None:
    request = request_in(src)
    if dst in EXPECTED_TABLE[src]:
        move(request, dst)
        assert request.state is dst
        assert request.is_terminal == (dst in TERMINAL)
    else:
        with pytest.raises(InvalidTransition):
            move(request, dst)
        assert request.state is src


def test_new_request_waits_with_nothing_attached() -> None:
    request = make_request()
    assert request.state is S.WAITING
    assert (request.error, request.finish_reason, request.page_table) == (None, None, ())
    assert (request.num_computed_tokens, request.output_ids) == (0, [])
    assert request.max_total_tokens == 7
    assert request.owner.request_id == "req-1" and request.owner.tenant == "tenant-a"


def test_token_ids_span_prompt_and_outputs() -> None:
    """What a recomputation after preemption feeds: the prompt, then the outputs so far."""
    request = make_request((5, 6, 7))
    request.output_ids += [8, 9]
    assert request.num_tokens == 5
    assert request.token_ids(0, 5) == (5, 6, 7, 8, 9)
    assert request.token_ids(1, 3) == (6, 7)
    assert request.token_ids(2, 4) == (7, 8)
    assert request.token_ids(4, 5) == (9,)


def test_terminal_outcomes_carry_their_reason_and_error() -> None:
    rejected = request_in(S.REJECTED)
    assert (rejected.finish_reason, rejected.error) == (FinishReason.ERROR, ERROR)
    aborted = request_in(S.ABORTED)
    assert (aborted.finish_reason, aborted.error) == (FinishReason.ABORT, None)
    failed = request_in(S.FAILED)
    assert (failed.finish_reason, failed.error) == (FinishReason.ERROR, ERROR)
    stopped = request_in(S.DECODING)
    stopped.transition(S.FINISHED, finish_reason=FinishReason.STOP)
    assert (stopped.finish_reason, stopped.error) == (FinishReason.STOP, None)


@pytest.mark.parametrize(
    ("src", "dst", "error", "reason"),
    [
        (S.DECODING, S.FINISHED, None, None),  # finished needs STOP or LENGTH
        (S.DECODING, S.FINISHED, None, FinishReason.ABORT),
        (S.DECODING, S.FINISHED, ERROR, FinishReason.STOP),  # finished carries no error
        (S.WAITING, S.REJECTED, None, None),  # rejected needs its error
        (S.DECODING, S.FAILED, None, None),
        (S.DECODING, S.FAILED, ERROR, FinishReason.STOP),
        (S.WAITING, S.ABORTED, None, FinishReason.LENGTH),
        (S.WAITING, S.PREFILLING, ERROR, None),  # non-terminal takes neither
        (S.PREFILLING, S.DECODING, None, FinishReason.STOP),
    ],
)
def test_inconsistent_outcomes_are_refused_and_change_nothing(
    src: RequestState,
    dst: RequestState,
    error: ContextLengthExceeded | None,
    reason: FinishReason | None,
) -> None:
    request = request_in(src)
    with pytest.raises(InvalidTransition):
        request.transition(dst, error, finish_reason=reason)
    assert (request.state, request.error, request.finish_reason) == (src, None, None)


def test_failure_may_carry_any_typed_error() -> None:
    request = request_in(S.DECODING)
    request.transition(S.FAILED, OutOfPages(1, 0))
    assert request.error is not None and request.error.code == "kv_pool_exhausted"


def test_repr_shows_counts_never_token_ids() -> None:
    request = make_request(prompt=(987654, 876543, 765432))
    request.output_ids.append(123456)
    text = repr(request)
    for token in ("987654", "876543", "765432", "123456"):
        assert token not in text
    assert "prompt_tokens=3" in text and "output_tokens=1" in text and "state=waiting" in text


def test_prompt_is_immutable() -> None:
    prompt = [1, 2, 3]
    request = make_request(prompt=tuple(prompt))
    assert request.prompt_ids == (1, 2, 3)
    assert isinstance(Request("r", "t", prompt, SamplingParams(1)).prompt_ids, tuple)


def test_request_needs_ids() -> None:
    with pytest.raises(ValueError):
        Request("", "tenant", (1,), SamplingParams(1))
    with pytest.raises(ValueError):
        Request("req", "", (1,), SamplingParams(1))


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": 1, "temperature": -0.01}, "temperature"),
        ({"max_tokens": 1, "temperature": 2.01}, "temperature"),
        ({"max_tokens": 1, "temperature": float("nan")}, "temperature"),
        ({"max_tokens": 1, "top_p": 0.0}, "top_p"),
        ({"max_tokens": 1, "top_p": 1.01}, "top_p"),
        ({"max_tokens": 1, "top_p": float("inf")}, "top_p"),
        ({"max_tokens": 1, "seed": "7"}, "seed"),
        ({"max_tokens": 1, "stop_token_ids": (1, -2)}, "stop_token_ids"),
    ],
)
def test_sampling_params_refuse_out_of_range(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert caught.value.param == param
    assert caught.value.http_status == 400


def test_sampling_params_accept_boundaries_and_normalise_stop_ids() -> None:
    assert SamplingParams(max_tokens=1, temperature=0, top_p=1.0).temperature == 0
    assert SamplingParams(max_tokens=1, temperature=2.0, top_p=1e-9).top_p == 1e-9
    params = SamplingParams(max_tokens=5, seed=7, stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert params.stop_token_ids == (3, 4)
    assert SamplingParams(max_tokens=1).stop_token_ids == ()


@pytest.mark.parametrize("tiny", [4e-257, 5e-324, 1e-6, 0.000999])
def test_a_temperature_below_the_floor_is_greedy_on_every_path(tiny: float) -> None:
    # float32 logits divided by it overflow to inf: the whole batch's step would fail.
    assert SamplingParams(max_tokens=1, temperature=tiny).temperature == 0.0
    assert SamplingParams(max_tokens=1, temperature=MIN_SAMPLING_TEMPERATURE).temperature > 0
