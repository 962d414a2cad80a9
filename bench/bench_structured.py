"""Benchmark of grammar-constrained decoding: constrained vs unconstrained tok/s, and the mask cost.

Run: ``python -m bench.bench_structured [--quick] [--rounds N]``. One CPU process, greedy, a
randomly initialised fp32 Llama of ``bench_engine``'s shape with a 32,000-token byte-level BPE
vocabulary (``write_checkpoint``: the mask's cost grows with the vocabulary, so the byte model's
259 tokens would understate it), served by one in-process ``AsyncEngine`` to 1 and 32 closed-loop
clients (``bench.engine_ours.closed_loop``). Two sides, interleaved ABBA over rounds:

- unconstrained: plain sampling;
- constrained: every request under the grammar of ``SCHEMA`` (an object with one string too long
  to close within ``max_tokens``, so both sides generate the same number of tokens), compiled once
  before the run as the HTTP edge does, masked every step by xgrammar (``backend.engine.grammar``).

Each concurrency starts with one discarded warm-up run of each side.

Printed per side and concurrency: output tokens/s (tokens generated / wall time; both sides
count what they generated) and, for the constrained side, the mask's cost per constrained token
(fill + apply, ``GrammarBackend.mask_seconds / masked_rows``). Headlines: constrained /
unconstrained tok/s at 1 and 32 clients (goal >= 0.9x, issue 30). Exit 1 if one is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.config import BackendSettings
from backend.core.request import FinishReason, SamplingParams
from backend.engine.build import BuiltEngine, build_engine
from backend.server.structured import schema_spec
from bench.engine_common import ModelShape, Trace
from bench.engine_ours import closed_loop
from bench.summary import emit

SHAPE = ModelShape(hidden=512, layers=12, intermediate=1536, heads=8, kv_heads=4)
VOCAB = 32_000
# one string that cannot close before max_tokens: both sides generate exactly as many tokens
SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 2000}},
    "required": ["text"],
}
PROMPT_TOKENS, MAX_TOKENS = 64, 96
CONCURRENCY = (1, 32)
GOAL = 0.9


def write_checkpoint(directory: Path, *, seed: int) -> None:
    """A random Llama with a byte-level BPE vocabulary of ``VOCAB`` tokens: the 256 byte
    characters, then random 2-6 letter strings (text a grammar must inspect like real tokens;
    there are no merges: prompts are given as ids), and ``</s>`` last. Its LM-head row is zeroed,
    so greedy decoding practically never ends a request early (as ``bench_engine``'s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = random.Random(seed)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    letters = "abcdefghijklmnopqrstuvwxyzĠ"
    while len(vocab) < VOCAB - 1:
        vocab.setdefault("".join(rng.choice(letters) for _ in range(rng.randint(2, 6))), len(vocab))
    eos = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=SHAPE.hidden,
        intermediate_size=SHAPE.intermediate,
        num_hidden_layers=SHAPE.layers,
        num_attention_heads=SHAPE.heads,
        num_key_value_heads=SHAPE.kv_heads,
        max_position_embeddings=SHAPE.max_positions,
        bos_token_id=eos,
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[eos].zero_()
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


@dataclass(frozen=True, slots=True)
class Run:
    tokens_per_s: float
    mask_us_per_token: float | None


def _workload(requests: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256, VOCAB - 1) for _ in range(PROMPT_TOKENS)] for _ in range(requests)]


async def _serve(
    built: BuiltEngine, prompts: list[list[int]], clients: int, constrained: bool
) -> int:
    engine = built.engine
    engine.start()
    grammar = schema_spec(SCHEMA, strict=True) if constrained else None
    stops = tuple(sorted(built.tokenizer.stop_ids))
    produced = 0

    async def client(i: int, start: float) -> Trace:
        nonlocal produced
        trace = Trace(sent=time.perf_counter() - start)
        sampling = SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=stops, grammar=grammar
        )
        generation = engine.submit(
            request_id=f"r{i}-{time.monotonic_ns()}",
            tenant="bench",
            prompt_ids=prompts[i],
            sampling=sampling,
        )
        async for event in generation.events():
            if event.token is not None:
                produced += 1
                trace.record(time.perf_counter() - start, event.token)
            if event.is_terminal and event.finish_reason not in (
                FinishReason.LENGTH,
                FinishReason.STOP,
            ):
                raise RuntimeError(f"request {i} ended with {event.state}: {event.error}")
        return trace

    try:
        await closed_loop(_Count(len(prompts)), clients, client)  # type: ignore[arg-type]
    finally:
        await engine.stop()
    return produced


class _Count:
    """A workload as ``closed_loop`` reads it: its length (the prompts are this module's)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def measure(checkpoint: Path, clients: int, constrained: bool, requests: int, seed: int) -> Run:
    settings = BackendSettings(
        model=checkpoint, pool_tokens=65536, page_size=16, prefix_cache=False, max_running=64
    )
    built = build_engine(settings)
    if constrained:
        built.grammar.compile(schema_spec(SCHEMA, strict=True))  # as the HTTP edge does
    prompts = _workload(requests, seed)
    started = time.perf_counter()
    produced = asyncio.run(_serve(built, prompts, clients, constrained))
    elapsed = time.perf_counter() - started
    grammar = built.grammar
    mask = grammar.mask_seconds / grammar.masked_rows * 1e6 if grammar.masked_rows else None
    return Run(produced / elapsed, mask if constrained else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 2)
    torch.set_num_threads(1)
    print(f"model: random Llama, {SHAPE.describe()}, vocabulary {VOCAB}; one torch thread")
    print(f"workload: {PROMPT_TOKENS}-token prompts, up to {MAX_TOKENS} tokens, greedy")
    print(f"constrained: json_schema {json.dumps(SCHEMA)}")
    missed = False
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp)
        write_checkpoint(checkpoint, seed=0)
        print("\n| clients | unconstrained tok/s | constrained tok/s | ratio | mask us/token |")
        print("|---|---|---|---|---|")
        for clients in CONCURRENCY:
            requests = max(2 * clients, 4) if args.quick else max(3 * clients, 6)
            plain, bound, masks = [], [], []
            for constrained in (False, True):  # warm-up, discarded
                measure(checkpoint, clients, constrained, max(clients, 2), seed=99)
            for r in range(rounds):
                order = (False, True) if r % 2 == 0 else (True, False)  # ABBA
                for constrained in order:
                    run = measure(checkpoint, clients, constrained, requests, seed=r)
                    (bound if constrained else plain).append(run.tokens_per_s)
                    if run.mask_us_per_token is not None:
                        masks.append(run.mask_us_per_token)
            a, b = statistics.median(plain), statistics.median(bound)
            ratio = b / a
            mask = statistics.median(masks)
            print(f"| {clients} | {a:.1f} | {b:.1f} | {ratio:.2f}x | {mask:.1f} |")
            met = ratio >= GOAL
            missed |= not met
            emit(
                "bench_structured",
                f"decode tok/s at {clients} client{'s' if clients > 1 else ''}, "
                "json_schema / unconstrained",
                f"{ratio:.2f}x",
                f">= {GOAL}x",
                met,
            )
            emit(
                "bench_structured",
                f"grammar mask per constrained token at {clients} client"
                f"{'s' if clients > 1 else ''} (vocabulary {VOCAB})",
                f"{mask:.0f} us",
            )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
