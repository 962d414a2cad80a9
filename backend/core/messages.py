"""The typed messages of one engine step: ``SchedulerOutput`` in, ``StepResult`` out.

One step reads as three calls::

    out = scheduler.schedule()                  # 1. pick work; reserve pages for new requests
    runner.zero(out.pages_to_zero)              # 2a. zero freed pages' memory, then
    scheduler.pool.confirm_zeroed(out.pages_to_zero)  #   make them allocatable again
    for item in out.decodes + out.prefills:     # 2b. read-path check before attention
        scheduler.pool.verify(item.page_table, item.request.owner)
    sampled = runner.run(out).tokens            # 2c. forward + sample: {request_id: token | None}
    results = scheduler.postprocess(out, sampled)   # 3. advance, append, finish, free

A ``PrefillChunk`` writes K/V for prompt positions ``[start, end)``; only the chunk that ends the
prompt samples a token. A ``DecodeItem`` feeds ``input_token`` at ``position`` and samples one.
Token ids are content: they are left out of every repr here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.core.pages import PageRef
from backend.core.request import TERMINAL, FinishReason, Request, RequestState


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    request: Request
    start: int
    end: int
    page_table: tuple[PageRef, ...]

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def samples(self) -> bool:
        """Whether this chunk completes the prompt, so the runner samples the first token."""
        return self.end == self.request.num_prompt_tokens

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_ids[self.start : self.end]


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
class StepResult:
    """One sampled token and what it did to its request."""

    request_id: str
    token: int = field(repr=False)
    state: RequestState
    finish_reason: FinishReason | None

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL
