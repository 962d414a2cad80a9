"""Triton paged attention against the PyTorch reference: interpreted on CPU, natively on a GPU.

Why a subprocess: `triton.jit` decides between compiling and interpreting when the decorator
runs, i.e. when `backend.kernels.triton_paged` is first imported, by reading TRITON_INTERPRET at
that moment. Setting the variable inside this pytest process would be too late if any other test
had already imported the module, and would silently turn the GPU test into an interpreter run if
it came first. So the interpreter check runs this same file as a script in a child process with
TRITON_INTERPRET=1, and asserts there that the kernels really are interpreted; the GPU test runs
the same cases in-process against compiled kernels.

The interpreter costs about a second per launch, so the cases are few and small: one decode
launch (GQA, pages scattered, lengths crossing several key blocks and a page size that does not
divide the block), one mixed launch (prefill chunks after earlier context, with decodes), the same
two with a sliding window, and one model forward (two layers, the second with a window). Slots a
sequence does not own are filled with NaN first: any read outside a sequence's pages would show
up in the output.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backend.kernels.metadata import AttentionMetadata
from backend.kernels.paged_attention import paged_attention

REPO_ROOT = Path(__file__).resolve().parents[3]


def _metadata(query_lens, kv_lens, page_size, num_pages, device):
    ids = list(range(num_pages))
    random.Random(7).shuffle(ids)
    tables, used = [], 0
    for kv_len in kv_lens:
        n = -(-kv_len // page_size)
        tables.append(ids[used : used + n])
        used += n
    md = AttentionMetadata.build(
        query_lens=query_lens,
        kv_lens=kv_lens,
        block_tables=tables,
        page_size=page_size,
        num_pages=num_pages,
        device=device,
    )
    owned = {
        tb[t // page_size] * page_size + t % page_size
        for kv, tb in zip(kv_lens, tables, strict=True)
        for t in range(kv)
    }
    return md, owned


def _check_attention(query_lens, kv_lens, device, dtype, atol, window=None):
    torch.manual_seed(0)
    page_size, num_pages, heads, kv_heads, head_dim = 5, 48, 4, 2, 24
    md, owned = _metadata(query_lens, kv_lens, page_size, num_pages, device)
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    foreign = torch.tensor([s not in owned for s in range(num_pages * page_size)], device=device)
    k_cache.view(-1, kv_heads, head_dim)[foreign] = float("nan")
    v_cache.view(-1, kv_heads, head_dim)[foreign] = float("nan")
    q = torch.randn(md.num_tokens, heads, head_dim, device=device, dtype=dtype)

    got = paged_attention(q, k_cache, v_cache, md, 0.2, backend="triton", window=window)
    want = paged_attention(
        q.float(), k_cache.float(), v_cache.float(), md, 0.2, backend="torch", window=window
    )

    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)


def _check_model_forward(device):
    from backend.model.checkpoint import expected_shapes
    from backend.model.config import ModelConfig
    from backend.model.llama import LlamaModel

    config = ModelConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        vocab_size=50, max_position_embeddings=128, tie_word_embeddings=True,
        bos_token_id=None, eos_token_ids=(1,), torch_dtype="float32",
        layer_windows=(None, 6),  # the second layer slides (Mistral), the first does not
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=gen) * 0.3 for n, s in expected_shapes(config).items()}
    model = LlamaModel(config, {n: t.to(device) for n, t in state.items()})
    md, _ = _metadata([9, 1, 1], [9, 30, 4], 4, 20, device)
    ids = torch.randint(0, 50, (md.num_tokens,), generator=gen).to(device)
    logits = {}
    for backend in ("torch", "triton"):
        cache = model.new_kv_cache(20, 4)
        torch.manual_seed(1)  # the decodes' earlier context: random, identical for both backends
        cache.k.normal_()
        cache.v.normal_()
        logits[backend] = model(
            ids, md.positions(), md, cache, all_logits=True, attention_backend=backend
        )
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


def run_cases(device: str, dtypes: tuple[torch.dtype, ...]) -> None:
    for dtype in dtypes:
        atol = 1e-5 if dtype == torch.float32 else 2e-2
        _check_attention([1, 1, 1, 1], [1, 70, 33, 5], device, dtype, atol)  # decode kernel
        _check_attention([20, 1, 5, 1], [37, 50, 5, 1], device, dtype, atol)  # chunk kernel
        # sliding windows: keys older than the window are skipped by whole blocks and masked
        _check_attention([1, 1, 1, 1], [1, 70, 33, 5], device, dtype, atol, window=9)
        _check_attention([20, 1, 5, 1], [37, 50, 5, 1], device, dtype, atol, window=7)
    _check_model_forward(device)


def test_triton_kernels_match_reference_in_interpreter():
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "interpreted kernels match the reference" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_match_reference_on_gpu():
    from backend.kernels import triton_paged

    assert type(triton_paged._decode_kernel).__name__ == "JITFunction"  # compiled, not interpreted
    run_cases("cuda", (torch.float32, torch.bfloat16, torch.float16))


if __name__ == "__main__":
    from backend.kernels import triton_paged

    kernel_kind = type(triton_paged._decode_kernel).__name__
    assert kernel_kind == "InterpretedFunction", f"TRITON_INTERPRET not honoured: {kernel_kind}"
    run_cases("cpu", (torch.float32,))
    print("interpreted kernels match the reference")
