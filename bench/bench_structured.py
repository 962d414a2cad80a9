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

Each concurrency runs on one engine: a discarded warm-up run of each side, then rounds of both
sides on the same prompts, next to each other in ABBA order; the headline is the median of the
rounds' paired ratios (with their range), which a busy machine moves less than absolute numbers.

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
    constrained: bool
    tokens_per_s: float


def _workload(requests: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256, VOCAB - 1) for _ in range(PROMPT_TOKENS)] for _ in range(requests)]


async def _serve(
    built: BuiltEngine, prompts: list[list[int]], clients: int, constrained: bool
) -> int:
    """Serve ``prompts`` with ``clients`` closed-loop clients; the tokens generated."""
    engine = built.engine
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

    await closed_loop(_Count(len(prompts)), clients, client)  # type: ignore[arg-type]
    return produced


class _Count:
    """A workload as ``closed_loop`` reads it: its length (the prompts are this module's)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def measure(checkpoint: Path, clients: int, rounds: int, requests: int) -> tuple[list[Run], float]:
    """One engine, a warm-up of each side, then ``rounds`` of both sides in ABBA order on the
    same prompts per round: the runs, and the mask's microseconds per constrained token."""
    settings = BackendSettings(
        model=checkpoint, pool_tokens=65536, page_size=16, prefix_cache=False, max_running=64
    )
    built = build_engine(settings)
    built.grammar.compile(schema_spec(SCHEMA, strict=True), "bench")  # as the HTTP edge does

    async def all_runs() -> list[Run]:
        built.engine.start()
        runs = []
        try:
            for constrained in (False, True):  # warm-up, discarded
                await _serve(built, _workload(max(clients, 2), 99), clients, constrained)
            built.grammar.mask_seconds, built.grammar.masked_rows = 0.0, 0
            for r in range(rounds):
                prompts = _workload(requests, r)
                for constrained in (False, True) if r % 2 == 0 else (True, False):
                    started = time.perf_counter()
                    produced = await _serve(built, prompts, clients, constrained)
                    runs.append(Run(constrained, produced / (time.perf_counter() - started)))
        finally:
            await built.engine.stop()
        return runs

    runs = asyncio.run(all_runs())
    grammar = built.grammar
    return runs, grammar.mask_seconds / max(1, grammar.masked_rows) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 4)
    torch.set_num_threads(1)
    print(f"model: random Llama, {SHAPE.describe()}, vocabulary {VOCAB}; one torch thread")
    print(f"workload: {PROMPT_TOKENS}-token prompts, up to {MAX_TOKENS} tokens, greedy")
    print(f"constrained: json_schema {json.dumps(SCHEMA)}")
    missed = False
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp)
        write_checkpoint(checkpoint, seed=0)
        head = (
            "| clients | unconstrained tok/s | constrained tok/s | ratio (range) | mask us/token |"
        )
        print("\n" + head)
        print("|---|---|---|---|---|")
        for clients in CONCURRENCY:
            requests = (2 if args.quick else 3) * max(clients, 2)
            runs, mask = measure(checkpoint, clients, rounds, requests)
            plain = [run.tokens_per_s for run in runs if not run.constrained]
            bound = [run.tokens_per_s for run in runs if run.constrained]
            # each round ran both sides on the same prompts, next to each other: paired ratios
            ratio = statistics.median(b / a for a, b in zip(plain, bound, strict=True))
            spread = f"{min(b / a for a, b in zip(plain, bound, strict=True)):.2f}.." + (
                f"{max(b / a for a, b in zip(plain, bound, strict=True)):.2f}x"
            )
            a, b = statistics.median(plain), statistics.median(bound)
            print(f"| {clients} | {a:.1f} | {b:.1f} | {ratio:.2f}x ({spread}) | {mask:.1f} |")
            met = ratio >= GOAL
            missed |= not met
            emit(
                "bench_structured",
                f"decode tok/s at {clients} client{'s' if clients > 1 else ''}, "
                "json_schema / unconstrained",
                f"{ratio:.2f}x ({spread})",
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
