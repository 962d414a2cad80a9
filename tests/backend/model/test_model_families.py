"""Each family's tiny checkpoint in the engine against transformers' own model class, in-process.

- loads: `load_model` reads what the family's config.json says (architecture, biases, window,
  RoPE variant, tied embeddings) and the engine builds from it;
- logits: every position's logits of prompts run through the paged path (pages scattered, prefill
  chunked, decoded token by token, several requests in one step) equal transformers' full-sequence
  logits; prompts are longer than the Mistral-style window and than Llama 3's original context;
- greedy: the engine core (scheduler, runner, real page pool) generates exactly transformers'
  greedy tokens, stopping where `generate` stops on the family's stop tokens.
The HTTP side (one engine process per family) is test_model_families_http.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from paged_steps import PagedRequests, hf_logits, run_step
from tiny_families import FAMILIES, FAMILY_NAMES, PROMPTS, hf_greedy

from backend.config import BackendSettings
from backend.core.request import Request, SamplingParams
from backend.engine.build import build_engine
from backend.model.llama import load_model

PAGE_SIZE = 4
NUM_PAGES = 96

EXPECTED = {
    "llama2": dict(architecture="LlamaForCausalLM", qkv_bias=False, windows=(), rope="dynamic"),
    "llama3": dict(architecture="LlamaForCausalLM", qkv_bias=False, windows=(), rope="llama3"),
    "qwen2": dict(architecture="Qwen2ForCausalLM", qkv_bias=True, windows=(), rope=None),
    "mistral": dict(architecture="MistralForCausalLM", qkv_bias=False, windows=(12, 12), rope=None),
    "smollm": dict(architecture="LlamaForCausalLM", qkv_bias=False, windows=(), rope=None),
    "qwen3": dict(architecture="Qwen3ForCausalLM", qkv_bias=False, windows=(), rope="yarn"),
    "gemma3": dict(
        architecture="Gemma3ForCausalLM", qkv_bias=False, windows=(8, None) * 2, rope="linear"
    ),
    "phi3": dict(architecture="Phi3ForCausalLM", qkv_bias=False, windows=(24, 24), rope="longrope"),
}
# RoPE whose frequencies follow a sequence's length (transformers recomputes them every forward):
# chunked prefill is not the same computation there, in transformers either
BY_LENGTH = {"llama2", "phi3"}


@pytest.fixture(scope="module")
def engine_model(family_checkpoint):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_model(family_checkpoint(name))
        return cache[name]

    return get


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_loads(family, engine_model, hf_family):
    model, config, tokenizer = engine_model(family)
    _, hf = hf_family(family)
    want = EXPECTED[family]
    assert config.architecture == want["architecture"] == type(hf).__name__
    assert config.qkv_bias == want["qkv_bias"]
    assert config.layer_windows == want["windows"]
    assert (config.rope_scaling and config.rope_scaling.rope_type) == want["rope"]
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert config.vocab_size == hf.config.vocab_size >= tokenizer.vocab_size
    assert model.dtype == torch.float32


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_prompt_logits(family, engine_model, hf_family):
    model, config, _ = engine_model(family)
    _, hf = hf_family(family)
    gen = random.Random(1)
    a, b, c = ([gen.randrange(config.vocab_size) for _ in range(n)] for n in (70, 23, 9))
    steps = [
        [("a", a[0:30], 30), ("b", b[0:7], 7)],
        [("a", a[30:61], 61), ("b", b[7:8], 8), ("c", c[0:5], 5)],
        [("b", b[8:21], 21), ("a", a[61:62], 62), ("c", c[5:6], 6)],
        *([("a", a[i : i + 1], i + 1), ("b", b[21 + i - 62 : 22 + i - 62], 22 + i - 62)]
          for i in range(62, 63)),
        *([("a", a[i : i + 1], i + 1), ("c", c[i - 57 : i - 56], i - 56)] for i in range(63, 66)),
        *([("a", a[i : i + 1], i + 1)] for i in range(66, 70)),
    ]  # fmt: skip
    if family in BY_LENGTH:  # each sequence whole in one step, as transformers computes it
        steps = [[("a", a, 70), ("b", b[:22], 22), ("c", c, 9)]]
    pages = PagedRequests(2, NUM_PAGES, PAGE_SIZE)
    cache = model.new_kv_cache(NUM_PAGES, PAGE_SIZE)
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    for step in steps:
        for name, logits in run_step(model, cache, pages, step).items():
            got[name].append(logits)
    assert sum(len(x) for x in got["b"]) == 22 and sum(len(x) for x in got["c"]) == 9

    for name, ids in (("a", a), ("b", b[:22]), ("c", c)):
        want = hf_logits(hf, ids)
        torch.testing.assert_close(torch.cat(got[name]), want, atol=1e-4, rtol=1e-4)
    assert pages.tables["a"] != sorted(pages.tables["a"])  # really scattered


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_greedy_tokens(family, family_checkpoint, hf_family):
    """Eight prompts at once through the engine core, each equal to transformers' greedy."""
    tok, hf = hf_family(family)
    built = build_engine(
        BackendSettings(model=family_checkpoint(family), pool_tokens=1024, page_size=16)
    )
    stops = set(built.tokenizer.stop_ids)
    assert stops == {tok.convert_tokens_to_ids(t) for t in FAMILIES[family].stop_tokens}
    requests = []
    for i, prompt in enumerate(PROMPTS):
        ids = tok(prompt)["input_ids"]
        sampling = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=tuple(stops))
        requests.append(Request(f"r{i}", "tenant", ids, sampling))
        built.engine.core.add(requests[-1])
    while built.engine.core.has_work():
        built.engine.core.step()

    for request, prompt in zip(requests, PROMPTS, strict=True):
        want = hf_greedy(hf, list(request.prompt_ids), 12, stops)
        assert request.output_ids == want, prompt


def test_longrope_recomputes_a_sequence_that_crosses_its_original_window(
    family_checkpoint, hf_family
):
    """Phi-3's longrope switches to its long factors once a sequence is longer than
    original_max_position_embeddings (32 here), and transformers then recomputes the whole
    sequence's KV with them (Phi3ForCausalLM.prepare_inputs_for_generation drops its cache). The
    engine preempts the request at that step, so it is recomputed whole: 28 prompt tokens and 12
    greedy ones equal transformers', where keeping the short-factor KV diverged at token 6."""
    tok, hf = hf_family("phi3")
    built = build_engine(
        BackendSettings(model=family_checkpoint("phi3"), pool_tokens=1024, page_size=16)
    )
    stops = set(built.tokenizer.stop_ids)
    gen = random.Random(3)
    prompt = [gen.randrange(10, 300) for _ in range(28)]
    request = Request("crossing", "tenant", prompt, SamplingParams(max_tokens=12, temperature=0.0))
    built.engine.core.add(request)
    while built.engine.core.has_work():
        built.engine.core.step()
    assert built.engine.core.scheduler.num_preemptions == 1  # once, at 32 computed tokens
    assert request.output_ids == hf_greedy(hf, prompt, 12, stops)
