"""The GPU half of the model checks, run by `scripts/gpu-check` (see there). Needs CUDA.

1. bf16 parity: each tiny family checkpoint saved in bf16, served in bf16 on the GPU through the
   Triton kernels and through the torch path, against transformers in bf16 on the same GPU.
2. Throughput: decode steps and one prefill of a random-weight 8-layer model (hidden 2048, GQA
   16:4, head_dim 128, bf16) through both attention backends, timed with CUDA events, outputs
   compared.
Prints two tables; exits 1 if a parity bound is broken. Thresholds are first estimates: this has
not run on a GPU yet, so the first run's numbers are what should set them.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "backend" / "model")]

from backend.kernels.metadata import AttentionMetadata  # noqa: E402
from backend.model.checkpoint import expected_shapes  # noqa: E402
from backend.model.config import ModelConfig  # noqa: E402
from backend.model.llama import LlamaModel, load_model  # noqa: E402

DEVICE = "cuda"
PARITY_BOUND = 0.05  # of the largest logit; bf16 vs fp32 is ~5% on CPU for these models


def _logits(model: LlamaModel, ids: list[int], backend: str) -> torch.Tensor:
    pages = -(-len(ids) // 16)
    md = AttentionMetadata.build(
        query_lens=[len(ids)],
        kv_lens=[len(ids)],
        block_tables=[list(range(pages - 1, -1, -1))],  # reversed: not contiguous
        page_size=16,
        device=DEVICE,
    )
    cache = model.new_kv_cache(pages, 16)
    tokens = torch.tensor(ids, device=DEVICE)
    return model(tokens, md.positions(), md, cache, all_logits=True, attention_backend=backend)


def parity() -> list[tuple[str, float, float, float]]:
    import transformers
    from tiny_families import FAMILIES, write_family

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, family in FAMILIES.items():
            path = write_family(family, Path(tmp) / name, dtype="bfloat16")
            model, config, _ = load_model(path, device=DEVICE, dtype=torch.bfloat16)
            rng = random.Random(0)
            ids = [rng.randrange(config.vocab_size) for _ in range(67)]
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
            with torch.no_grad():
                want = hf.to(DEVICE)(torch.tensor([ids], device=DEVICE)).logits[0].float()
            triton = _logits(model, ids, "triton").float()
            reference = _logits(model, ids, "torch").float()
            scale = float(want.abs().max())
            rows.append(
                (
                    name,
                    float((triton - want).abs().max()) / scale,
                    float((reference - want).abs().max()) / scale,
                    float((triton - reference).abs().max()) / scale,
                )
            )
    return rows


def _big_model() -> LlamaModel:
    config = ModelConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        vocab_size=32000, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=1, eos_token_ids=(2,), torch_dtype="bfloat16",
    )  # fmt: skip
    gen = torch.Generator(device="cpu").manual_seed(0)
    state = {
        n: (torch.randn(s, generator=gen) * 0.02).to(DEVICE, torch.bfloat16)
        for n, s in expected_shapes(config).items()
    }
    return LlamaModel(config, state).eval()


def _time_step(model: LlamaModel, query_lens: list[int], kv_lens: list[int], backend: str):
    pages_per = [-(-kv // 16) for kv in kv_lens]
    order = list(range(sum(pages_per)))
    random.Random(1).shuffle(order)
    tables, used = [], 0
    for n in pages_per:
        tables.append(order[used : used + n])
        used += n
    md = AttentionMetadata.build(
        query_lens=query_lens, kv_lens=kv_lens, block_tables=tables, page_size=16, device=DEVICE
    )
    cache = model.new_kv_cache(sum(pages_per), 16)
    cache.k.normal_()
    cache.v.normal_()
    ids = torch.randint(0, 32000, (md.num_tokens,), device=DEVICE)
    run = lambda: model(ids, md.positions(), md, cache, attention_backend=backend)  # noqa: E731
    for _ in range(3):
        out = run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        out = run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 10, out.float()


def throughput() -> list[tuple[str, float, float, float, float]]:
    model = _big_model()
    workloads = [
        ("decode 1 x 1024", [1], [1024]),
        ("decode 32 x 1024", [1] * 32, [1024] * 32),
        ("decode 64 x 2048", [1] * 64, [2048] * 64),
        ("prefill 1 x 2048", [2048], [2048]),
        ("mixed 512-chunk + 31 decodes", [512] + [1] * 31, [1536] + [1024] * 31),
    ]
    rows = []
    for label, query_lens, kv_lens in workloads:
        torch_ms, torch_out = _time_step(model, query_lens, kv_lens, "torch")
        triton_ms, triton_out = _time_step(model, query_lens, kv_lens, "triton")
        diff = float((torch_out - triton_out).abs().max() / torch_out.abs().max())
        tokens = sum(query_lens)
        rows.append((label, torch_ms, triton_ms, tokens / triton_ms * 1000, diff))
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU here; nothing was run", file=sys.stderr)
        return 2
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(
        "\nbf16 parity (max |difference| / max |logit|, 67-token prompt, transformers bf16 on GPU)"
    )
    print("| family | triton vs transformers | torch vs transformers | triton vs torch |")
    print("|---|---|---|---|")
    failed = False
    for name, triton_hf, torch_hf, triton_torch in parity():
        failed |= max(triton_hf, torch_hf, triton_torch) > PARITY_BOUND
        print(f"| {name} | {triton_hf:.4f} | {torch_hf:.4f} | {triton_torch:.4f} |")
    print("\nattention backends, 8 layers x hidden 2048, GQA 16:4, bf16, one forward step")
    print("| workload | torch path ms | triton ms | triton tokens/s | speedup | max diff |")
    print("|---|---|---|---|---|---|")
    for label, torch_ms, triton_ms, tps, diff in throughput():
        failed |= diff > PARITY_BOUND
        speedup = torch_ms / triton_ms
        cells = f"{torch_ms:.2f} | {triton_ms:.2f} | {tps:,.0f} | {speedup:.2f}x | {diff:.4f}"
        print(f"| {label} | {cells} |")
    print("\nFAILED: a difference is above the bound" if failed else "\nall bounds held")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
