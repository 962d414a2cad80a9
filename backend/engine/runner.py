"""The model runner: all device work of one engine step, and nothing else.

It turns a ``SchedulerOutput`` into one flattened forward pass over the paged KV cache and
samples the tokens the scheduler asked for. It knows page ids only through the page tables the
scheduler handed out (already verified against the pool by the engine core) and never decides
what runs: requests that went terminal before the forward are simply left out.

A request with a grammar (``SamplingParams.grammar``) samples under its matcher's mask
(``backend.engine.grammar``) and advances the matcher with the token; a request whose outputs its
grammar does not accept (``GrammarViolation``) gets no token and is named in
``StepSamples.failed``, which the engine core fails before postprocess.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from backend.core.errors import KvguardError
from backend.core.grammar import GrammarViolation
from backend.core.messages import SchedulerOutput, TokenLogprobs
from backend.core.request import Request
from backend.engine.grammar import GrammarBackend, Matcher
from backend.engine.sampling import sample
from backend.kernels.metadata import AttentionMetadata
from backend.kernels.paged_attention import Backend
from backend.model.kv_cache import KVCache
from backend.model.llama import LlamaModel


@dataclass(frozen=True, slots=True)
class _Seq:
    request: Request
    tokens: Sequence[int]
    start: int  # position of the first query token
    samples: bool


@dataclass(slots=True)
class StepSamples:
    """What one step sampled: ``{request_id: token or None}`` (None for chunks that do not end a
    prompt), and the logprobs of the requests that asked for them."""

    tokens: dict[str, int | None] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict, repr=False)
    failed: dict[str, KvguardError] = field(default_factory=dict)  # no token: fail these


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        *,
        attention_backend: Backend | None = None,
        grammar: GrammarBackend | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend
        self.grammar = grammar

    @property
    def page_size(self) -> int:
        return self.kv_cache.page_size

    def zero(self, page_ids: Sequence[int]) -> None:
        if page_ids:
            self.kv_cache.zero_pages(list(page_ids))

    def run(self, output: SchedulerOutput) -> StepSamples:
        """Forward every live item of the step and sample the tokens it asks for."""
        seqs = _plan(output)
        if not seqs:
            return StepSamples()
        device = self.model.device
        input_ids = torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int64)
        metadata = AttentionMetadata.build(
            query_lens=[len(s.tokens) for s in seqs],
            kv_lens=[s.start + len(s.tokens) for s in seqs],
            block_tables=[[ref.page_id for ref in s.request.page_table] for s in seqs],
            page_size=self.page_size,
            num_pages=self.kv_cache.num_pages,
            device=device,
        )
        logits = self.model.forward(
            input_ids.to(device),
            metadata.positions(),
            metadata,
            self.kv_cache,
            attention_backend=self.attention_backend,
        )
        rows = [i for i, s in enumerate(seqs) if s.samples]
        requests = [seqs[i].request for i in rows]
        result = StepSamples({s.request.request_id: None for s in seqs})
        masked = self._matchers(requests, result.failed)
        grammar = self.grammar
        sampled = sample(
            logits[rows] if rows else logits[:0],
            [r.sampling for r in requests],
            [r.num_output_tokens for r in requests],
            [r.output_ids for r in requests],
            constrain=(lambda x: grammar.mask(x, masked)) if masked and grammar else None,
        )
        for request, one in zip(requests, sampled, strict=True):
            request_id = request.request_id
            if request_id in result.failed:
                continue
            if isinstance(request.grammar, Matcher) and not request.grammar.accept(one.token):
                position = request.num_output_tokens
                result.failed[request_id] = GrammarViolation(request_id, position)
                continue
            result.tokens[request_id] = one.token
            if one.logprobs is not None:
                result.logprobs[request_id] = one.logprobs
        return result

    def _matchers(
        self, requests: list[Request], failed: dict[str, KvguardError]
    ) -> list[tuple[int, Matcher]]:
        """(row, matcher) of the constrained requests; a matcher that cannot be rebuilt names
        its request in ``failed``."""
        if self.grammar is None:
            for request in requests:
                if request.sampling.grammar is not None:  # the server refuses these; never here
                    failed[request.request_id] = GrammarViolation(request.request_id, 0)
            return []
        rows = []
        for row, request in enumerate(requests):
            if request.sampling.grammar is None:
                continue
            try:
                rows.append((row, self.grammar.state_for(request)))
            except KvguardError as error:  # a replayed token refused, a schema that cannot compile
                failed[request.request_id] = error
        return rows


def _plan(output: SchedulerOutput) -> list[_Seq]:
    seqs = [
        _Seq(item.request, (item.input_token,), item.position, True)
        for item in output.decodes
        if not item.request.is_terminal
    ]
    seqs += [
        _Seq(chunk.request, chunk.token_ids, chunk.start, chunk.samples)
        for chunk in output.prefills
        if not chunk.request.is_terminal
    ]
    return seqs
