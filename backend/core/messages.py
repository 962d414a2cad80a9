"""The typed messages of one engine step: ``SchedulerOutput`` in, ``StepResult`` out.

One step reads as three calls::

    out = scheduler.schedule()                  # 1. pick work; reserve pages for new requests
    runner.zero(out.pages_to_zero)              # 2a. zero freed pages' memory, then
    scheduler.pool.confirm_zeroed(out.pages_to_zero)  #   make them allocatable again
    for item in out.decodes + out.prefills:     # 2b. read-path check before attention
        scheduler.pool.verify(item.page_table, item.request.owner)
    sampled = runner.run(out).tokens            # 2c. forward + sample: {request_id: token | None}
    results = scheduler.postprocess(out, sampled)   # 3. advance, append, finish, free

A ``PrefillChunk`` writes K/V for positions ``[start, end)`` of the request's tokens (its prompt,
and after a preemption the output tokens it already had); only the chunk that ends them samples a
token. A ``DecodeItem`` feeds ``input_token`` at ``position`` and samples one.
Token ids are content: they are left out of every repr here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from backend.core.errors import StepProtocolError
from backend.core.pages import PageRef
from backend.core.request import TERMINAL, FinishReason, Request, RequestState


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    request: Request
    start: int
    end: int
    page_table: tuple[PageRef, ...]
    num_tokens_to_compute: int  # the request's tokens when scheduled (prompt [+ outputs])

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def samples(self) -> bool:
        """Whether this chunk ends the tokens to compute, so the runner samples the next one.

        Fixed when the chunk is scheduled: the sampled token is appended in ``postprocess``."""
        return self.end == self.num_tokens_to_compute

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.request.token_ids(self.start, self.end)


@dataclass(frozen=True, slots=True)
class DecodeItem:
    request: Request
    position: int
    input_token: int = field(repr=False)
    page_table: tuple[PageRef, ...]

    @property
    def num_context_tokens(self) -> int:
        """Tokens attention reads, this step's input included."""
        return self.position + 1


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the runner needs for one step; the scheduler hands out exactly one at a time.

    ``pages_to_zero``: pages released since the previous step that must be zeroed (then
    ``PagePool.confirm_zeroed``) before they can be allocated again; empty without zero_on_free.
    """

    step: int
    decodes: tuple[DecodeItem, ...]
    prefills: tuple[PrefillChunk, ...]
    pages_to_zero: tuple[int, ...]

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(chunk.num_tokens for chunk in self.prefills)

    @property
    def is_empty(self) -> bool:
        """No model work this step (there may still be pages to zero)."""
        return not self.decodes and not self.prefills

    @property
    def sampling_request_ids(self) -> tuple[str, ...]:
        """Requests the runner must sample a token for, in batch order."""
        decode_ids = tuple(item.request.request_id for item in self.decodes)
        return decode_ids + tuple(c.request.request_id for c in self.prefills if c.samples)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The sampled token's log-probability and the ``(token, logprob)`` most likely alternatives,
    most likely first (``backend.engine.sampling``; prefill sends the first token's in its
    handoff result)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = field(default=(), repr=False)


@dataclass(frozen=True, slots=True)
class StepResult:
    """One sampled token and what it did to its request."""

    request_id: str
    token: int = field(repr=False)
    state: RequestState
    finish_reason: FinishReason | None

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL


def check_sampled(output: SchedulerOutput, sampled: Mapping[str, int | None]) -> None:
    """Raise ``StepProtocolError`` if the runner's tokens do not answer ``output`` exactly: a
    token for each live request that must sample, and for nothing else."""
    must_sample = set(output.sampling_request_ids)
    requests = [item.request for item in output.decodes]
    requests += [chunk.request for chunk in output.prefills]
    scheduled = {request.request_id for request in requests}
    for request_id, token in sampled.items():
        if request_id not in scheduled:
            raise StepProtocolError(f"token for {request_id!r}, which was not scheduled")
        if token is not None and request_id not in must_sample:
            raise StepProtocolError(f"token for {request_id!r}, whose prompt is not done")
        if token is not None and (isinstance(token, bool) or not isinstance(token, int)):
            raise StepProtocolError(f"token for {request_id!r} is not an int")
        if token is not None and token < 0:
            raise StepProtocolError(f"negative token id for {request_id!r}")
    for request in requests:
        rid = request.request_id
        if rid in must_sample and not request.is_terminal and sampled.get(rid) is None:
            raise StepProtocolError(f"no token for {rid!r}, which had to sample")
