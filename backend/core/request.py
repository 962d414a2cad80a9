"""One generation request and its lifecycle.

Lifecycle (``TRANSITIONS``; any other move raises ``InvalidTransition``)::

    WAITING ──admitted, first pages taken──▶ PREFILLING ──prompt done──▶ DECODING
       │                                      │    ▲ └──first token ends it──▶ FINISHED
       │                                      │    │                              ▲
       │                            preempted │    │ re-admitted                  │
       │                                      ▼    │                              │
       │                                    PREEMPTED ◀──preempted── DECODING ────┘
       │                                      (no pages; recomputes its tokens when re-admitted)
       ├──admission refused──▶ REJECTED
       ├──▶ ABORTED | FAILED           (and from PREFILLING, DECODING, PREEMPTED)
       │
       └──pages reserved, KV comes from a prefill node──▶ AWAITING_KV      (decode role only)
              AWAITING_KV ──KV accepted on positive evidence──▶ DECODING | FINISHED
              AWAITING_KV ──prefill rejected it──▶ REJECTED (with prefill's original error)
              AWAITING_KV ──▶ ABORTED | FAILED

``TERMINAL`` = {FINISHED, REJECTED, ABORTED, FAILED}: nothing leaves them. The state is the one
source of truth: there is no "finished" flag beside it, and ``finish_reason`` / ``error`` are set
only by ``transition`` together with the terminal state they explain, so a consumer that asks
"is it terminal?" can never miss a rejection (the incident's bug).

PREEMPTED is not an ending: the scheduler took the request's pages back (through the same release
path as any other: generation bumped on reuse, zeroed before reuse) and will recompute every
token it has (prompt and output so far) when pages are free again, then carry on sampling. Its
output tokens stay, so a preempted request's answer is the one it would have given unpreempted.

AWAITING_KV is the decode role's handoff state: the request holds its reserved pages, but nothing
may read them until the handoff is verified (``backend.disagg``). It can end REJECTED because a
prefill node's own admission is the second line of defence, and its refusal must reach the client
as the same error a unified engine gives. A role that never uses a state simply never enters it;
queues select requests by state, so a new state is invisible to code that does not ask for it, and
a terminal handoff outcome is one of the existing terminal states, never a boolean beside the enum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from backend.core.errors import InvalidRequest, InvalidTransition, KvguardError
from backend.core.grammar import GrammarSpec, GrammarState
from backend.core.pages import Owner, PageRef
from contracts.lifecycle import check_move


class RequestState(StrEnum):
    WAITING = "waiting"
    AWAITING_KV = "awaiting_kv"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"
    FAILED = "failed"


TERMINAL: frozenset[RequestState] = frozenset(
    {RequestState.FINISHED, RequestState.REJECTED, RequestState.ABORTED, RequestState.FAILED}
)

# States of a request that holds no pages and waits for them (new, or preempted).
WAITING_STATES = frozenset({RequestState.WAITING, RequestState.PREEMPTED})

TRANSITIONS: Mapping[RequestState, frozenset[RequestState]] = MappingProxyType(
    {
        RequestState.WAITING: frozenset(
            {
                RequestState.PREFILLING,
                RequestState.AWAITING_KV,
                RequestState.REJECTED,
                RequestState.ABORTED,
                RequestState.FAILED,
            }
        ),
        RequestState.AWAITING_KV: frozenset(
            {
                RequestState.DECODING,
                RequestState.FINISHED,
                RequestState.REJECTED,
                RequestState.ABORTED,
                RequestState.FAILED,
            }
        ),
        RequestState.PREFILLING: frozenset(
            {
                RequestState.DECODING,
                RequestState.FINISHED,
                RequestState.PREEMPTED,
                RequestState.ABORTED,
                RequestState.FAILED,
            }
        ),
        RequestState.DECODING: frozenset(
            {
                RequestState.FINISHED,
                RequestState.PREEMPTED,
                RequestState.ABORTED,
                RequestState.FAILED,
            }
        ),
        RequestState.PREEMPTED: frozenset(
            {RequestState.PREFILLING, RequestState.ABORTED, RequestState.FAILED}
        ),
        RequestState.FINISHED: frozenset(),
        RequestState.REJECTED: frozenset(),
        RequestState.ABORTED: frozenset(),
        RequestState.FAILED: frozenset(),
    }
)


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


# Which finish reasons explain which terminal state; REJECTED and FAILED must carry their error.
_FINISH_REASONS: Mapping[RequestState, frozenset[FinishReason]] = MappingProxyType(
    {
        RequestState.FINISHED: frozenset({FinishReason.STOP, FinishReason.LENGTH}),
        RequestState.REJECTED: frozenset({FinishReason.ERROR}),
        RequestState.ABORTED: frozenset({FinishReason.ABORT}),
        RequestState.FAILED: frozenset({FinishReason.ERROR}),
    }
)
_NEEDS_ERROR = frozenset({RequestState.REJECTED, RequestState.FAILED})


def _number(param: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(param, f"must be a finite number, got {value!r}")
    return float(value)


# A temperature above 0 but below this is served greedily (its limit): dividing float32 logits
# by it overflows to inf, and the step of the whole batch would fail.
MIN_SAMPLING_TEMPERATURE = 1e-3


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens; validated on construction (``InvalidRequest``, HTTP 400). A
    temperature under ``MIN_SAMPLING_TEMPERATURE`` becomes 0 (greedy) on every path: the HTTP
    edge, the prefill handoff and in-process callers alike."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # OpenAI's penalties over the tokens generated so far (logit -= count * frequency + presence)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # report each token's logprob and this many top alternatives
    grammar: GrammarSpec | None = None  # the output must match it (backend.core.grammar)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequest("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0.0 <= _number("temperature", self.temperature) <= 2.0:
            raise InvalidRequest("temperature", f"must be in [0, 2], got {self.temperature}")
        if self.temperature < MIN_SAMPLING_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not 0.0 < _number("top_p", self.top_p) <= 1.0:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidRequest("seed", f"must be an integer or null, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _number(name, getattr(self, name)) <= 2.0:
                raise InvalidRequest(name, f"must be in [-2, 2], got {getattr(self, name)}")
        bias = tuple((token, _number("logit_bias", value)) for token, value in self.logit_bias)
        for token, value in bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequest("logit_bias", "keys must be non-negative token ids")
            if not -100.0 <= value <= 100.0:
                raise InvalidRequest("logit_bias", f"biases must be in [-100, 100], got {value}")
        object.__setattr__(self, "logit_bias", bias)
        top = self.logprobs
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
            raise InvalidRequest("logprobs", f"must be a non-negative integer, got {top!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise InvalidRequest("response_format", "the grammar must be a GrammarSpec")

    @property
    def shapes_logits(self) -> bool:
        """Whether penalties or biases change the logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


def _token_ids(values: Iterable[int]) -> tuple[int, ...]:
    ids = tuple(values)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequest("stop_token_ids", "must be non-negative integers")
    return ids


class Request:
    """A request's identity, prompt, sampling, lifecycle state and KV page table.

    ``state``, ``error`` and ``finish_reason`` change only through ``transition``. The scheduler
    owns ``page_table`` (pages for the tokens it computes: taken at admission for the tokens to
    prefill, one more page whenever decoding crosses into a new page; emptied when the request ends
    or is preempted; its head may be prefix-cache pages it reads), ``num_computed_tokens`` (tokens
    whose K/V is written, or read from the cache), ``output_ids`` and ``preemptions``. The prompt is
    an immutable tuple: nothing may swap it for a placeholder.
    """

    __slots__ = (
        "_error",
        "_finish_reason",
        "_state",
        "cache_scope",
        "cached_upto",
        "grammar",
        "num_computed_tokens",
        "output_ids",
        "owner",
        "page_keys",
        "page_table",
        "preemptions",
        "prompt_ids",
        "request_id",
        "sampling",
        "tenant",
    )

    def __init__(
        self, request_id: str, tenant: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> None:
        if not request_id or not tenant:
            raise ValueError("request_id and tenant must be non-empty")
        self.request_id = request_id
        self.tenant = tenant
        self.prompt_ids: tuple[int, ...] = tuple(prompt_ids)
        self.sampling = sampling
        # One Owner object for the request's life: PagePool.verify's fast path compares identity.
        self.owner = Owner(request_id, tenant)
        self.page_table: tuple[PageRef, ...] = ()
        self.num_computed_tokens = 0
        self.output_ids: list[int] = []
        self.preemptions = 0
        # The prefix cache's (backend.core.prefix_cache): the request's namespace, the hash-chain
        # keys of its full pages so far, and how many leading pages it has considered for caching.
        self.cache_scope: str | None = None
        self.page_keys: list[bytes] = []
        self.cached_upto = 0
        # The matcher of ``sampling.grammar``, built by the runner at the first sampling step and
        # kept across preemptions (``backend.core.grammar``); None while unbuilt or unconstrained.
        self.grammar: GrammarState | None = None
        self._state = RequestState.WAITING
        self._error: KvguardError | None = None
        self._finish_reason: FinishReason | None = None

    @property
    def state(self) -> RequestState:
        return self._state

    @property
    def error(self) -> KvguardError | None:
        return self._error

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._finish_reason

    @property
    def is_terminal(self) -> bool:
        return self._state in TERMINAL

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far: what a (re)computation from scratch writes."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        """prompt + max_tokens: what admission checks; the page table never outgrows it."""
        return len(self.prompt_ids) + self.sampling.max_tokens

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens at positions ``[start, end)`` of prompt + output."""
        prompt = self.prompt_ids
        if end <= len(prompt):
            return prompt[start:end]
        outputs = self.output_ids[max(0, start - len(prompt)) : end - len(prompt)]
        return prompt[start:] + tuple(outputs)

    def transition(
        self,
        to: RequestState,
        error: KvguardError | None = None,
        *,
        finish_reason: FinishReason | None = None,
    ) -> None:
        """Move to ``to`` if ``TRANSITIONS`` allows it, with the error/reason a terminal needs.

        FINISHED needs ``finish_reason`` STOP or LENGTH; REJECTED and FAILED need ``error`` (their
        reason is ERROR); ABORTED's reason is ABORT (``error`` optional). Non-terminal states take
        neither. On any violation nothing changes and ``InvalidTransition`` is raised.
        """
        check_move(TRANSITIONS, "request", self.request_id, self._state, to)
        reason = self._check_outcome(to, error, finish_reason)
        self._state = to
        self._error = error
        self._finish_reason = reason

    def _check_outcome(
        self, to: RequestState, error: KvguardError | None, reason: FinishReason | None
    ) -> FinishReason | None:
        def refuse(problem: str) -> InvalidTransition:
            return InvalidTransition("request", self.request_id, self._state, to, problem)

        allowed = _FINISH_REASONS.get(to)
        if allowed is None:
            if error is not None or reason is not None:
                raise refuse("a non-terminal state takes no error or finish_reason")
            return None
        if reason is None and len(allowed) == 1:
            (reason,) = allowed
        if reason not in allowed:
            raise refuse(f"finish_reason must be one of {sorted(allowed)}, got {reason}")
        if to in _NEEDS_ERROR and error is None:
            raise refuse("needs the error that caused it")
        if to is RequestState.FINISHED and error is not None:
            raise refuse("a finished request carries no error")
        return reason

    def __repr__(self) -> str:
        # Token ids are content: show counts only.
        error = self._error.code if self._error is not None else None
        return (
            f"Request(id={self.request_id!r}, tenant={self.tenant!r}, state={self._state}, "
            f"prompt_tokens={len(self.prompt_ids)}, output_tokens={len(self.output_ids)}, "
            f"computed={self.num_computed_tokens}, pages={len(self.page_table)}, "
            f"preemptions={self.preemptions}, "
            f"finish_reason={self._finish_reason}, error={error})"
        )


def waiting_problems(request: Request) -> list[str]:
    """What is wrong with ``request`` sitting in a queue of requests that hold no pages: new
    (WAITING, no progress at all) or PREEMPTED (its output tokens kept, nothing computed)."""
    if request.state not in WAITING_STATES:
        return [f"{request!r} is in a waiting queue"]
    if request.page_table or request.num_computed_tokens:
        return [f"waiting {request!r} holds pages or computed tokens"]
    if request.state is RequestState.WAITING and request.output_ids:
        return [f"new {request!r} already has output tokens"]
    if request.num_output_tokens >= request.sampling.max_tokens:
        return [f"waiting {request!r} has all its tokens"]
    return []
