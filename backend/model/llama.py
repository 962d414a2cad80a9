"""`LlamaModel`: a Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) over a flattened ragged batch.

One class serves Llama (optionally biased attention, scaled RoPE), Mistral (sliding window), Qwen2
(q/k/v bias, tied embeddings), Qwen3 (q/k norms), Gemma 3 (norms scaling by 1 + w around attention
and the MLP, q/k norms, a scaled embedding, GELU-tanh, interleaved sliding layers with their own
RoPE) and Phi-3 (fused tensors in the checkpoint, longrope): the differences are fields of
`ModelConfig`, and transformers' own classes are the reference the tests hold it to.

Lifecycle of one forward step (driven by the runner):
1. the runner concatenates this step's tokens of every scheduled sequence (prefill chunks and
   decode tokens alike) into `input_ids [T]` with their absolute `positions [T]`, and describes
   the batch with an `AttentionMetadata` (query offsets, KV lengths, block tables, slots);
2. each layer projects Q/K/V (plus bias; q/k norms), applies RoPE, writes the new K/V into the
   `KVCache` at `slot_mapping`, then attends over the sequence's pages through its block table
   (within the layer's sliding window, if any);
3. the final norm and LM head run on each sequence's last token (or every token, for tests),
   returning float32 logits.

The model owns weights only; the KV cache and the page assignment belong to the runner.
`load_model` builds the model, its config and tokenizer from a local checkpoint directory.

Compute dtype (`compute_dtype`): what the caller asks for, else float32 on CPU whatever the
checkpoint stores (bf16 -> fp32 is exact, so a bf16 checkpoint gives transformers' fp32 logits of
the same weights; CPU half-precision matmuls are slower than fp32 here and less exact), else on a
GPU the checkpoint's own dtype (`torch_dtype` in config.json). The KV cache uses the same dtype.
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
from backend.model.rope import Rope, Rotary
from backend.model.tokenizer import Tokenizer, load_tokenizer

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


def compute_dtype(
    config: ModelConfig, device: torch.device | str, requested: str = "auto"
) -> torch.dtype:
    """The dtype the model computes (and caches KV) in; see the module docstring."""
    if requested != "auto":
        return dtype_from_name(requested)
    if torch.device(device).type == "cpu":
        return torch.float32
    return dtype_from_name(config.torch_dtype)


@dataclass(frozen=True, slots=True)
class _Step:
    """What every layer of one forward step shares."""

    metadata: AttentionMetadata
    kv_cache: KVCache
    backend: Backend
    # the reference path's plans, prepared once per step for each sliding window in use
    plans: dict[int | None, AttentionPlan]
    # (cos, sin) of the full-attention layers and, when they have their own, the sliding ones
    rope: tuple[torch.Tensor, torch.Tensor]
    sliding_rope: tuple[torch.Tensor, torch.Tensor] | None


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
    so each is a single matmul (Phi-3 stores them fused already). Optional weights are None when
    the checkpoint has none: biases (Qwen2's q/k/v, Llama's attention_bias), q/k norms (Qwen3,
    Gemma 3), the norms around the MLP (Gemma 3). Gemma's norms scale by ``1 + w``: stored so."""

    def __init__(
        self, state: dict[str, torch.Tensor], prefix: str, window: int | None, config: ModelConfig
    ) -> None:
        super().__init__()
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        self.window = window
        if config.fused_checkpoint:
            qkv, gate_up = state[attn + "qkv_proj.weight"], state[mlp + "gate_up_proj.weight"]
        else:
            qkv = torch.cat([state[attn + f"{n}_proj.weight"] for n in ("q", "k", "v")], 0)
            gate_up = torch.cat([state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]])
        self.register_buffer("qkv", _in_out(qkv))
        self.register_buffer("o", _in_out(state[attn + "o_proj.weight"]))
        q_b, k_b, v_b = (state.get(attn + f"{n}_proj.bias") for n in "qkv")
        qkv_bias = None if q_b is None or k_b is None or v_b is None else torch.cat([q_b, k_b, v_b])
        self.register_buffer("qkv_bias", qkv_bias)
        self.register_buffer("o_bias", state.get(attn + "o_proj.bias"))
        self.register_buffer("gate_up", _in_out(gate_up))
        self.register_buffer("down", _in_out(state[mlp + "down_proj.weight"]))

        def norm(name: str) -> torch.Tensor | None:
            weight = state.get(name)
            return weight + 1 if weight is not None and config.gemma else weight

        self.register_buffer("input_norm", norm(prefix + "input_layernorm.weight"))
        self.register_buffer("post_norm", norm(prefix + "post_attention_layernorm.weight"))
        self.register_buffer("q_norm", norm(attn + "q_norm.weight"))
        self.register_buffer("k_norm", norm(attn + "k_norm.weight"))
        self.register_buffer("pre_ff_norm", norm(prefix + "pre_feedforward_layernorm.weight"))
        self.register_buffer("post_ff_norm", norm(prefix + "post_feedforward_layernorm.weight"))

    qkv: torch.Tensor
    o: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    pre_ff_norm: torch.Tensor | None
    post_ff_norm: torch.Tensor | None


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor]) -> None:
        """`state` holds HF tensor names (see `checkpoint.expected_shapes`)."""
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            _DecoderLayer(state, f"model.layers.{i}.", config.window(i), config)
            for i in range(config.num_hidden_layers)
        )
        embed = state["model.embed_tokens.weight"]
        self.register_buffer("embed", embed)
        final_norm = state["model.norm.weight"]
        self.register_buffer("norm", final_norm + 1 if config.gemma else final_norm)
        # [hidden, vocab]; tied, it is a view of the embedding (no second copy)
        head = embed.t() if config.tie_word_embeddings else _in_out(state["lm_head.weight"])
        self.register_buffer("lm_head", head)
        full = Rope(config.rope_theta, config.rope_scaling)
        self.rotary = Rotary(full, config.head_dim, config.max_position_embeddings, embed.device)
        self.sliding_rotary = None
        if config.sliding_rope is not None:
            sliding = config.sliding_rope
            positions = config.max_position_embeddings
            self.sliding_rotary = Rotary(sliding, config.head_dim, positions, embed.device)
        self.scale = config.query_scale or config.head_dim**-0.5
        # Gemma scales the embedding by sqrt(hidden_size), rounded to the weights' dtype
        self.embed_scale = (
            torch.tensor(config.hidden_size**0.5).to(embed.dtype) if config.gemma else None
        )

    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor

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
        if metadata.max_kv_len > self.config.max_positions:
            raise ValueError(
                f"a sequence reaches {metadata.max_kv_len} tokens; the model supports "
                f"{self.config.max_positions} (max_position_embeddings, and its RoPE's extension)"
            )
        backend = attention_backend or default_backend(input_ids.device)
        plans = {}
        if backend == "torch":
            for window in {cast(_DecoderLayer, layer).window for layer in self.layers}:
                plans[window] = plan_attention(
                    metadata, kv_bytes_per_token=kv_cache.kv_bytes_per_token, window=window
                )
        step = _Step(metadata, kv_cache, backend, plans, *self._ropes(positions, metadata))
        hidden = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        for i, layer in enumerate(self.layers):
            hidden = self._layer(i, cast(_DecoderLayer, layer), hidden, step)
        if not all_logits and metadata.num_tokens != metadata.num_seqs:
            hidden = hidden[metadata.last_token_indices()]
        return (self._rms_norm(hidden, self.norm) @ self.lm_head).float()

    def _layer(
        self, index: int, layer: _DecoderLayer, hidden: torch.Tensor, step: _Step
    ) -> torch.Tensor:
        attn = self._attention(index, layer, self._rms_norm(hidden, layer.input_norm), step)
        if layer.pre_ff_norm is None or layer.post_ff_norm is None:  # Llama's order
            hidden = hidden + attn
            gate, up = (self._rms_norm(hidden, layer.post_norm) @ layer.gate_up).chunk(2, -1)
            return hidden + (F.silu(gate) * up) @ layer.down
        # Gemma 3: a norm after attention and on both sides of the MLP
        hidden = hidden + self._rms_norm(attn, layer.post_norm)
        gate, up = (self._rms_norm(hidden, layer.pre_ff_norm) @ layer.gate_up).chunk(2, -1)
        mlp = (F.gelu(gate, approximate="tanh") * up) @ layer.down
        return hidden + self._rms_norm(mlp, layer.post_ff_norm)

    def _attention(
        self, index: int, layer: _DecoderLayer, normed: torch.Tensor, step: _Step
    ) -> torch.Tensor:
        c = self.config
        heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        tokens = normed.shape[0]
        qkv = normed @ layer.qkv
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:  # per head, before RoPE
            qk = torch.cat(
                (
                    self._rms_norm(qk[:, :heads], layer.q_norm),
                    self._rms_norm(qk[:, heads:], layer.k_norm),
                ),
                dim=1,
            )
        cos, sin = (
            step.rope if layer.window is None or step.sliding_rope is None else step.sliding_rope
        )
        # RoPE on Q and K together: they are adjacent heads of the fused projection.
        qk = _apply_rope(qk, cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        step.kv_cache.write(index, step.metadata.slot_mapping, k, v)
        k_pages, v_pages = step.kv_cache.layer(index)
        attn = paged_attention(
            q,
            k_pages,
            v_pages,
            step.metadata,
            self.scale,
            step.backend,
            step.plans.get(layer.window),
            layer.window,
        )
        out = attn.reshape(tokens, heads * head_dim) @ layer.o
        return out if layer.o_bias is None else out + layer.o_bias

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused op on the hot path
        # As transformers: normalise in float32, then Llama casts back and scales, Gemma scales
        # in float32 and casts back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        if self.config.gemma:
            return (x32 * weight.float()).to(x.dtype)
        return weight * x32.to(x.dtype)

    def _ropes(
        self, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
        """(cos, sin) of this step's tokens for the full layers and, if any, the sliding ones."""
        lengths = metadata.kv_lens_host, metadata.query_lens_host
        full = self.rotary.cos_sin(positions, self.dtype, *lengths)
        if self.sliding_rotary is None:
            return full, None
        return full, self.sliding_rotary.cos_sin(positions, self.dtype, *lengths)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def load_model(
    checkpoint_dir: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[LlamaModel, ModelConfig, Tokenizer]:
    """Config, tokenizer and weights from local disk; `dtype` defaults to `compute_dtype`'s."""
    config = ModelConfig.from_dir(checkpoint_dir)
    tokenizer = load_tokenizer(checkpoint_dir, config)
    chosen = dtype or compute_dtype(config, device)
    state = load_state_dict(checkpoint_dir, config, device=device, dtype=chosen)
    return LlamaModel(config, state).eval(), config, tokenizer
