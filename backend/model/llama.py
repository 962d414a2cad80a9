"""`LlamaModel`: a Llama decoder (RMSNorm, RoPE, GQA, SwiGLU) over a flattened ragged batch.

Lifecycle of one forward step (driven by the runner):
1. the runner concatenates this step's tokens of every scheduled sequence (prefill chunks and
   decode tokens alike) into `input_ids [T]` with their absolute `positions [T]`, and describes
   the batch with an `AttentionMetadata` (query offsets, KV lengths, block tables, slots);
2. each layer projects Q/K/V, applies RoPE, writes the new K/V into the `KVCache` at
   `slot_mapping`, then attends over the sequence's pages through its block table;
3. the final norm and LM head run on each sequence's last token (or every token, for tests),
   returning float32 logits.

The model owns weights only; the KV cache and the page assignment belong to the runner.
`load_model` builds the model, its config and tokenizer from a local checkpoint directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from backend.kernels.metadata import AttentionMetadata
from backend.kernels.paged_attention import Backend, default_backend, paged_attention
from backend.kernels.torch_paged import AttentionPlan, plan_attention
from backend.model.checkpoint import load_state_dict
from backend.model.config import ModelConfig
from backend.model.kv_cache import KVCache
from backend.model.tokenizer import Tokenizer, load_tokenizer

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True, slots=True)
class _Step:
    """What every layer of one forward step shares."""

    metadata: AttentionMetadata
    kv_cache: KVCache
    backend: Backend
    plan: AttentionPlan | None  # the reference path's plan, prepared once for all layers


def _in_out(weight: torch.Tensor) -> torch.Tensor:
    """An HF ``[out, in]`` projection stored ``[in, out]``, for ``x @ w``.

    Why: on CPU (MKL, fp32) a decode step of 1-2 tokens is a matrix-vector product, and it reads
    the weights ~30% faster in this layout (measured on a 2-core EPYC, one thread: the 151 MB of
    projections of a 38M model in 9.6 ms instead of 13.6 ms). From 4 to 32 rows it is 4-13%
    slower, at prefill sizes (256 rows) even. Single requests are where batching cannot help, so
    they get the fast path.
    """
    return weight.t().contiguous()


class _DecoderLayer(nn.Module):
    """Weights of one layer, each ``[in, out]`` (see ``_in_out``); Q/K/V and gate/up are fused
    so each is a single matmul."""

    def __init__(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        qkv = [state[attn + f"{n}_proj.weight"] for n in ("q", "k", "v")]
        self.register_buffer("qkv", _in_out(torch.cat(qkv, 0)))
        self.register_buffer("o", _in_out(state[attn + "o_proj.weight"]))
        gate_up = [state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]]
        self.register_buffer("gate_up", _in_out(torch.cat(gate_up, 0)))
        self.register_buffer("down", _in_out(state[mlp + "down_proj.weight"]))
        self.register_buffer("input_norm", state[prefix + "input_layernorm.weight"])
        self.register_buffer("post_norm", state[prefix + "post_attention_layernorm.weight"])

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor]) -> None:
        """`state` holds HF LlamaForCausalLM tensor names (see `checkpoint.expected_shapes`)."""
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            _DecoderLayer(state, f"model.layers.{i}.") for i in range(config.num_hidden_layers)
        )
        embed = state["model.embed_tokens.weight"]
        self.register_buffer("embed", embed)
        self.register_buffer("norm", state["model.norm.weight"])
        # [hidden, vocab]; tied, it is a view of the embedding (no second copy)
        head = embed.t() if config.tie_word_embeddings else _in_out(state["lm_head.weight"])
        self.register_buffer("lm_head", head)
        # HF's default RoPE frequencies, computed exactly as transformers does.
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
        inv_freq = 1.0 / (config.rope_theta**exponents)
        self.register_buffer("inv_freq", inv_freq.to(embed.device), persistent=False)
        self.scale = config.head_dim**-0.5

    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor
    inv_freq: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_kv_cache(self, num_pages: int, page_size: int) -> KVCache:
        c = self.config
        return KVCache(
            c.num_hidden_layers,
            num_pages,
            page_size,
            c.num_key_value_heads,
            c.head_dim,
            self.dtype,
            self.device,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_cache: KVCache,
        *,
        all_logits: bool = False,
        attention_backend: Backend | None = None,
    ) -> torch.Tensor:
        """Logits [B, vocab] for each sequence's last token, or [T, vocab] with all_logits."""
        if input_ids.shape != positions.shape or input_ids.shape[0] != metadata.num_tokens:
            raise ValueError(
                f"input_ids {list(input_ids.shape)} and positions {list(positions.shape)} must "
                f"both be [{metadata.num_tokens}] (the metadata's token count)"
            )
        if metadata.max_kv_len > self.config.max_position_embeddings:
            raise ValueError(
                f"a sequence reaches {metadata.max_kv_len} tokens; the model supports "
                f"{self.config.max_position_embeddings} (max_position_embeddings)"
            )
        backend = attention_backend or default_backend(input_ids.device)
        plan = None
        if backend == "torch":
            plan = plan_attention(metadata, kv_bytes_per_token=kv_cache.kv_bytes_per_token)
        step = _Step(metadata, kv_cache, backend, plan)
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self._rope(positions)
        for i, layer in enumerate(self.layers):
            hidden = self._layer(i, cast(_DecoderLayer, layer), hidden, cos, sin, step)
        if not all_logits and metadata.num_tokens != metadata.num_seqs:
            hidden = hidden[metadata.last_token_indices()]
        return (self._rms_norm(hidden, self.norm) @ self.lm_head).float()

    def _layer(
        self,
        index: int,
        layer: _DecoderLayer,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: _Step,
    ) -> torch.Tensor:
        c = self.config
        heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        tokens = hidden.shape[0]
        qkv = self._rms_norm(hidden, layer.input_norm) @ layer.qkv
        # RoPE on Q and K together: they are adjacent heads of the fused projection.
        qk = _apply_rope(
            qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim), cos, sin
        )
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        step.kv_cache.write(index, step.metadata.slot_mapping, k, v)
        k_pages, v_pages = step.kv_cache.layer(index)
        attn = paged_attention(
            q, k_pages, v_pages, step.metadata, self.scale, step.backend, step.plan
        )
        hidden = hidden + attn.reshape(tokens, heads * head_dim) @ layer.o
        gate, up = (self._rms_norm(hidden, layer.post_norm) @ layer.gate_up).chunk(2, -1)
        return hidden + (F.silu(gate) * up) @ layer.down

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused op on the hot path
        # As transformers: normalise in float32, cast back, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] (broadcast over heads) in the model's dtype."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def load_model(
    checkpoint_dir: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[LlamaModel, ModelConfig, Tokenizer]:
    """Config, tokenizer and weights from local disk; `dtype` defaults to the config's."""
    config = ModelConfig.from_dir(checkpoint_dir)
    tokenizer = load_tokenizer(checkpoint_dir, config)
    chosen = dtype or dtype_from_name(config.torch_dtype)
    state = load_state_dict(checkpoint_dir, config, device=device, dtype=chosen)
    return LlamaModel(config, state).eval(), config, tokenizer
