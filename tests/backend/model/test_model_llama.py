"""LlamaModel against transformers' LlamaForCausalLM on the same randomly initialised checkpoint.

Every comparison runs through the paged path the engine uses: each request's pages are scattered
over shuffled, non-contiguous page ids, several requests share one forward, and prefill can be
chunked and followed by token-by-token decode. Logits must still equal transformers' logits for
the full sequence at every position. Weights are initialised with a large std so attention is
sharp and a wrong key, position or page would move the logits far beyond the tolerance.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import random

import pytest
import torch
import transformers
from paged_steps import PagedRequests, hf_logits, run_step

from backend.kernels.metadata import AttentionMetadata
from backend.model.llama import load_model
from backend.model.tokenizer import ByteTokenizer

PAGE_SIZE = 4
NUM_PAGES = 64
VOCAB = 300


def save_tiny_llama(path, **overrides):
    torch.manual_seed(0)
    settings = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        initializer_range=0.3,
        bos_token_id=256,
        eos_token_id=257,
        kvguard_tokenizer="byte",  # saved into config.json as an extra field
    )
    settings.update(overrides)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    hf = save_tiny_llama(path)
    model, config, tokenizer = load_model(path)
    return hf, model, config, tokenizer


def test_loads_config_and_byte_tokenizer(tiny):
    _, model, config, tokenizer = tiny
    assert isinstance(tokenizer, ByteTokenizer)
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (2, 2, 16)
    assert model.dtype == torch.float32


def test_batched_prompts_on_scattered_pages_match_transformers(tiny):
    hf, model, _, _ = tiny
    gen = random.Random(1)
    prompts = {f"r{n}": [gen.randrange(VOCAB) for _ in range(n)] for n in (1, 7, 16, 33)}
    pages = PagedRequests(2, NUM_PAGES, PAGE_SIZE)
    cache = model.new_kv_cache(NUM_PAGES, PAGE_SIZE)

    got = run_step(model, cache, pages, [(k, ids, len(ids)) for k, ids in prompts.items()])

    assert pages.tables["r33"] != sorted(pages.tables["r33"])  # really scattered
    for name, ids in prompts.items():
        torch.testing.assert_close(got[name], hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_then_decode_mixed_with_other_requests(tiny):
    hf, model, _, _ = tiny
    gen = random.Random(3)
    full = {
        "a": [gen.randrange(VOCAB) for _ in range(37)],
        "b": [gen.randrange(VOCAB) for _ in range(10)],
    }
    full["c"] = [gen.randrange(VOCAB) for _ in range(9)]
    a, b, c = full["a"], full["b"], full["c"]
    steps = [
        [("a", a[0:10], 10), ("b", b[0:7], 7)],
        [("a", a[10:23], 23), ("b", b[7:8], 8), ("c", c[0:5], 5)],
        [("b", b[8:9], 9), ("a", a[23:33], 33), ("c", c[5:6], 6)],
        [("a", a[33:34], 34), ("c", c[6:7], 7), ("b", b[9:10], 10)],
        [("c", c[7:8], 8), ("a", a[34:35], 35)],
        [("a", a[35:36], 36), ("c", c[8:9], 9)],
        [("a", a[36:37], 37)],
    ]
    pages = PagedRequests(4, NUM_PAGES, PAGE_SIZE)
    cache = model.new_kv_cache(NUM_PAGES, PAGE_SIZE)
    collected: dict[str, list[torch.Tensor]] = {k: [] for k in full}

    for step in steps:
        for name, logits in run_step(model, cache, pages, step).items():
            collected[name].append(logits)

    for name, ids in full.items():
        torch.testing.assert_close(
            torch.cat(collected[name]), hf_logits(hf, ids), atol=1e-4, rtol=1e-4
        )


def test_default_output_is_each_sequences_last_token(tiny):
    hf, model, _, _ = tiny
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14]]
    md = AttentionMetadata.build(
        query_lens=[3, 1, 6],
        kv_lens=[3, 1, 6],
        block_tables=[[3], [9], [1, 0]],
        page_size=PAGE_SIZE,
    )
    ids = torch.tensor([t for p in prompts for t in p])

    logits = model(ids, md.positions(), md, model.new_kv_cache(16, PAGE_SIZE))

    assert logits.shape == (3, VOCAB) and logits.dtype == torch.float32
    want = torch.stack([hf_logits(hf, p)[-1] for p in prompts])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_a_page_left_by_another_request_changes_the_answer(tiny):
    """Negative control for the comparisons above: the incident's failure mode is visible.

    Request B's decode step is given a block table that points at request A's first page instead
    of its own (stale KV, as when decode read pages prefill never wrote). The output must move
    far from transformers' logits; if the model ignored the cache, this test would fail.
    """
    hf, model, _, _ = tiny
    a, b = list(range(20, 28)), list(range(40, 48))
    cache = model.new_kv_cache(NUM_PAGES, PAGE_SIZE)
    pages = PagedRequests(5, NUM_PAGES, PAGE_SIZE)
    run_step(model, cache, pages, [("a", a, 8), ("b", b[:7], 7)])
    pages.tables["b"][0] = pages.tables["a"][0]

    got = run_step(model, cache, pages, [("b", b[7:8], 8)])["b"][0]

    assert (got - hf_logits(hf, b)[-1]).abs().max() > 0.5


def test_tied_embeddings_wide_heads_and_odd_page_size(tmp_path):
    """head_dim * heads != hidden, one KV head for four query heads, lm_head tied, page size 3."""
    hf = save_tiny_llama(tmp_path, head_dim=32, num_key_value_heads=1, tie_word_embeddings=True)
    model, config, _ = load_model(tmp_path)
    assert config.tie_word_embeddings and config.num_query_groups == 4
    gen = random.Random(6)
    prompts = [[gen.randrange(VOCAB) for _ in range(n)] for n in (11, 4)]
    md = AttentionMetadata.build(
        query_lens=[11, 4], kv_lens=[11, 4], block_tables=[[5, 0, 7, 2], [3, 6]], page_size=3
    )
    ids = torch.tensor([t for p in prompts for t in p])

    logits = model(ids, md.positions(), md, model.new_kv_cache(8, 3), all_logits=True)

    torch.testing.assert_close(logits[:11], hf_logits(hf, prompts[0]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[11:], hf_logits(hf, prompts[1]), atol=1e-4, rtol=1e-4)


def test_bfloat16_load_stays_close_to_float32(tiny, tmp_path):
    hf, _, _, _ = tiny
    save_tiny_llama(tmp_path)
    model, _, _ = load_model(tmp_path, dtype=torch.bfloat16)
    ids = list(range(100, 120))
    md = AttentionMetadata.build(
        query_lens=[20], kv_lens=[20], block_tables=[[4, 1, 9, 2, 0]], page_size=PAGE_SIZE
    )

    logits = model(
        torch.tensor(ids), md.positions(), md, model.new_kv_cache(10, PAGE_SIZE), all_logits=True
    )

    assert model.dtype == torch.bfloat16 and model.new_kv_cache(1, 1).dtype == torch.bfloat16
    want = hf_logits(hf, ids)
    # bf16 keeps ~3 significant digits; measured error is ~4% of the largest logit.
    assert (logits - want).abs().max() < 0.1 * want.abs().max()


def test_forward_refuses_inputs_that_disagree_with_the_metadata(tiny):
    _, model, _, _ = tiny
    md = AttentionMetadata.build(
        query_lens=[2], kv_lens=[2], block_tables=[[0]], page_size=PAGE_SIZE
    )
    with pytest.raises(ValueError, match="metadata"):
        model(
            torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), md, model.new_kv_cache(2, PAGE_SIZE)
        )


def test_forward_refuses_positions_beyond_the_models_window(tiny):
    _, model, config, _ = tiny
    too_long = config.max_position_embeddings + 1
    md = AttentionMetadata.build(
        query_lens=[1], kv_lens=[too_long], block_tables=[list(range(65))], page_size=PAGE_SIZE
    )
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.tensor([1]), md.positions(), md, model.new_kv_cache(65, PAGE_SIZE))


def test_llama_attention_bias_on_q_k_v_and_o(tmp_path):
    hf = save_tiny_llama(tmp_path, attention_bias=True)
    with torch.no_grad():  # transformers initialises biases to zero: make them count
        for name, param in hf.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    model, config, _ = load_model(tmp_path)
    assert (config.qkv_bias, config.o_bias) == (True, True)
    ids = list(range(40, 70))
    md = AttentionMetadata.build(
        query_lens=[30], kv_lens=[30], block_tables=[[7, 3, 5, 1, 0, 2, 4, 6]], page_size=PAGE_SIZE
    )
    logits = model(
        torch.tensor(ids), md.positions(), md, model.new_kv_cache(8, PAGE_SIZE), all_logits=True
    )
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
