"""Grammar-constrained sampling with xgrammar: compiled grammars, matchers, token masks.

Lifecycle (the spec and state are ``backend.core.grammar``'s):
1. start-up: ``GrammarBackend.for_tokenizer`` describes the vocabulary to xgrammar once (each
   token's text in the tokenizer's own encoding; special tokens blank, so a grammar can never
   emit one as text; the model's extra embedding rows blank too; the checkpoint's stop ids);
2. HTTP edge: ``compile(spec, tenant)`` turns a request's spec into a compiled grammar before
   anything is reserved (a schema xgrammar cannot compile is a 400 naming ``response_format``);
   compiled grammars are cached by tenant and spec, so the runner's compile for the same request
   is a lookup. Per tenant, as the prefix cache is: a shared cache would answer one tenant's
   schema faster once another tenant had used it, an oracle of what others ask for;
3. every sampling step (``ModelRunner``): ``state_for(request)`` builds the request's matcher
   the first time (replaying the outputs it already has), ``mask`` sets every token the matcher
   refuses to -inf in that row's logits, and after sampling ``accept`` advances it.

When the output is complete the matcher allows only the stop tokens, so a constrained answer ends
"stop" only when it matches; at ``max_tokens`` it ends "length" with the partial text. The time
spent filling and applying masks is counted (``mask_seconds``, ``masked_rows``): the cost per
constrained token is their ratio.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from backend.core.errors import InvalidRequest
from backend.core.grammar import GrammarKind, GrammarSpec, GrammarViolation
from backend.core.request import Request
from backend.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

_CACHE_SIZE = 256  # compiled grammars kept (a compiled JSON schema is tens of KB)
# JSON's string characters. xgrammar (0.2.9) writes a length-bounded string's (``maxLength``) as
# _LOOSE_CHARACTER, which lets through control characters JSON forbids in a string, and every
# string's classes let through UTF-8-encoded surrogates (U+D800-DFFF), which are not UTF-8 (a text
# holding one decodes to U+FFFD, three characters that break ``maxLength``). A random-weight
# model wrote both. Each class is replaced by _JSON_CHARACTER before compiling.
_LOOSE_CHARACTER = r"[^\"\\\r\n]"
_PLAIN_CHARACTER = r"[^\0-\x1f\"\\\r\n]"
_JSON_CHARACTER = r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]"
ANY_OBJECT = '{"type": "object"}'


class Matcher:
    """One request's ``GrammarState``: an xgrammar matcher."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarBackend:
    """xgrammar for one model's vocabulary (see the module docstring). Thread-safe: the HTTP
    edge compiles on worker threads while the engine thread builds matchers."""

    def __init__(self, info: Any, model_vocab_size: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        self._info = info
        self.vocab_size = model_vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, GrammarSpec], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.mask_seconds = 0.0
        self.masked_rows = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, model_vocab_size: int) -> GrammarBackend:
        import xgrammar

        stops = sorted(t for t in tokenizer.stop_ids if t < model_vocab_size)
        if isinstance(tokenizer, ByteTokenizer):
            raw = [bytes([b]) for b in range(256)]
            raw += [b""] * (model_vocab_size - 256)  # BOS, EOS, PAD and unused rows: no text
            info = xgrammar.TokenizerInfo(
                raw,
                vocab_type=xgrammar.VocabType.RAW,
                vocab_size=model_vocab_size,
                stop_token_ids=stops,
            )
            return cls(info, model_vocab_size)
        if not isinstance(tokenizer, HFTokenizer):
            raise TypeError(f"no grammar support for {type(tokenizer).__name__}")
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.rust)
        detected = xgrammar.TokenizerInfo.from_huggingface(
            fast, vocab_size=model_vocab_size, stop_token_ids=stops
        )
        vocab: list[str] = [""] * model_vocab_size
        for token_id in range(min(model_vocab_size, tokenizer.vocab_size)):
            if not tokenizer.textless(token_id):
                vocab[token_id] = tokenizer.rust.id_to_token(token_id) or ""
        info = xgrammar.TokenizerInfo(
            vocab,
            vocab_type=detected.vocab_type,
            vocab_size=model_vocab_size,
            stop_token_ids=stops,
            add_prefix_space=detected.add_prefix_space,
        )
        return cls(info, model_vocab_size)

    # -- compiling (HTTP edge and engine thread) -------------------------------------------------

    def compile(self, spec: GrammarSpec, tenant: str) -> Any:
        """The compiled grammar of ``spec`` (cached for ``tenant``); ``InvalidRequest`` if it
        cannot compile."""
        key = (tenant, spec)
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
                return found
        compiled = self._compile(spec)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        schema, strict = spec.schema, spec.strict
        if spec.kind is GrammarKind.JSON_OBJECT:  # any object: any members, any values
            schema, strict = ANY_OBJECT, False
        assert schema is not None
        try:
            grammar = self._xgr.Grammar.from_json_schema(
                schema, any_whitespace=False, strict_mode=strict
            )
            text = str(grammar)
            for loose in (_LOOSE_CHARACTER, _PLAIN_CHARACTER):
                text = text.replace(loose, _JSON_CHARACTER)
            return self._compiler.compile_grammar(self._xgr.Grammar.from_ebnf(text))
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its reason
            problem = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise InvalidRequest(
                "response_format", f"the JSON schema cannot be used: {problem}"
            ) from exc

    # -- the engine thread -----------------------------------------------------------------------

    def state_for(self, request: Request) -> Matcher:
        """The request's matcher, built now if it has none, with its outputs replayed; raises
        ``GrammarViolation`` when an output it already has is not allowed."""
        if isinstance(request.grammar, Matcher):
            return request.grammar
        spec = request.sampling.grammar
        assert spec is not None
        matcher = Matcher(self._xgr.GrammarMatcher(self.compile(spec, request.tenant)))
        for position, token in enumerate(request.output_ids):
            if not matcher.accept(token):
                raise GrammarViolation(request.request_id, position)
        request.grammar = matcher
        return matcher

    def mask(self, logits: torch.Tensor, rows: Sequence[tuple[int, Matcher]]) -> None:
        """Set every token a row's matcher refuses to -inf (``logits`` [B, vocab], in place)."""
        if not rows:
            return
        started = time.perf_counter()
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i, (_, matcher) in enumerate(rows):
            matcher.fill(bitmask, i)
        picked = torch.tensor([row for row, _ in rows], dtype=torch.int64)
        sub = logits.index_select(0, picked)
        self._xgr.apply_token_bitmask_inplace(
            sub, bitmask.to(logits.device), vocab_size=self.vocab_size
        )
        logits.index_copy_(0, picked.to(logits.device), sub)
        self.mask_seconds += time.perf_counter() - started
        self.masked_rows += len(rows)
