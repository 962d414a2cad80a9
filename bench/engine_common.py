"""What every system in ``bench_engine`` shares: the checkpoint, the workload and the metrics.

Lifecycle of one measurement: ``write_random_checkpoint`` (once per run) -> ``make_workload``
(seeded: the same prompts and max_tokens for every system) -> a system serves the workload and
returns one ``Trace`` per request (times relative to the run's start) -> ``summarize`` turns the
traces into a ``Summary`` (output tokens/s, TTFT p50, per-token latency p50).

Every system is measured as the same closed loop: ``concurrency`` clients, client ``j`` sends
requests ``j, j + C, j + 2C, ...`` and sends the next one as soon as its previous response is
complete. TTFT is measured from the moment a request is sent, so it includes any queueing.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

BYTE_BOS, BYTE_EOS, BYTE_PAD, BYTE_VOCAB = 256, 257, 258, 259
_PRINTABLE = range(32, 127)


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    max_positions: int = 2048

    def describe(self) -> str:
        return (
            f"hidden {self.hidden}, {self.layers} layers, {self.heads} heads / "
            f"{self.kv_heads} KV heads, MLP {self.intermediate}"
        )


def write_random_checkpoint(directory: Path, shape: ModelShape, *, seed: int) -> int:
    """A randomly initialised byte-level Llama in HF layout (fp32); returns its parameter count.

    The EOS row of the LM head is zeroed: its logit is then 0 while the other 258 are random, so
    greedy decoding practically never picks EOS and every request produces exactly its
    ``max_tokens`` in every system (a random model would otherwise stop at arbitrary points).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        bos_token_id=BYTE_BOS,
        eos_token_id=BYTE_EOS,
        pad_token_id=BYTE_PAD,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[BYTE_EOS].zero_()
    model.save_pretrained(directory, safe_serialization=True)
    raw = json.loads((directory / "config.json").read_text())
    raw["kvguard_tokenizer"] = "byte"
    raw["torch_dtype"] = "float32"
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    seed: int

    def describe(self) -> str:
        (p_lo, p_hi), (o_lo, o_hi) = self.prompt_range, self.output_range
        return (
            f"{self.requests} requests, prompt tokens log-uniform in [{p_lo}, {p_hi}], "
            f"max_tokens log-uniform in [{o_lo}, {o_hi}], seed {self.seed}, greedy"
        )


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompts are BOS + printable ASCII, so the HTTP path can send them as text."""

    texts: tuple[str, ...] = field(repr=False)
    max_tokens: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.texts)

    def prompt_ids(self, i: int) -> list[int]:
        return [BYTE_BOS, *self.texts[i].encode("ascii")]

    def head(self, n: int, max_tokens: int) -> Workload:
        """The first ``n`` prompts with a small ``max_tokens`` (for warming up)."""
        return Workload(self.texts[:n], (max_tokens,) * min(n, len(self)))

    @property
    def prompt_tokens(self) -> int:
        return sum(len(t) + 1 for t in self.texts)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def make_workload(spec: WorkloadSpec) -> Workload:
    rng = random.Random(spec.seed)
    texts, max_tokens = [], []
    for _ in range(spec.requests):
        n_prompt = _log_uniform(rng, *spec.prompt_range)
        texts.append("".join(chr(rng.choice(_PRINTABLE)) for _ in range(n_prompt - 1)))
        max_tokens.append(_log_uniform(rng, *spec.output_range))
    return Workload(tuple(texts), tuple(max_tokens))


@dataclass(slots=True)
class Trace:
    """One request as its client saw it; seconds since the run started."""

    sent: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list, repr=False)

    def record(self, now: float, token: int | None = None) -> None:
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.tokens += 1
        if token is not None:
            self.token_ids.append(token)


@dataclass(frozen=True, slots=True)
class Summary:
    system: str
    concurrency: int
    tokens: int
    wall_s: float
    ttft_p50_ms: float
    tpot_p50_ms: float
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def summarize(system: str, concurrency: int, traces: Sequence[Trace], note: str = "") -> Summary:
    """Throughput over the whole run (first send to last token); latencies per request."""
    ends = [t.last_token for t in traces if t.last_token is not None]
    ttfts = [t.first_token - t.sent for t in traces if t.first_token is not None]
    tpots = [
        (t.last_token - t.first_token) / (t.tokens - 1)
        for t in traces
        if t.first_token is not None and t.last_token is not None and t.tokens > 1
    ]
    start = min(t.sent for t in traces)
    return Summary(
        system=system,
        concurrency=concurrency,
        tokens=sum(t.tokens for t in traces),
        wall_s=max(ends) - start,
        ttft_p50_ms=1000 * statistics.median(ttfts),
        tpot_p50_ms=1000 * statistics.median(tpots) if tpots else math.nan,
        note=note,
    )


def same_outputs(a: Sequence[Trace], b: Sequence[Trace]) -> int:
    """How many requests produced exactly the same token ids in both runs."""
    return sum(1 for x, y in zip(a, b, strict=True) if x.token_ids == y.token_ids)
