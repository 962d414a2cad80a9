"""The bundled model's own PyTorch module: a Llama decoder with Hugging Face tensor names.

Used to build, train and evaluate `kvguard-tiny` without the engine. Its `state_dict()` keys are
exactly those of `transformers.LlamaForCausalLM` (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `lm_head.weight`), and its arithmetic is the same
(RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU), so an exported checkpoint gives the
same logits under transformers (the tests check it).

Two ways to run it:
- `forward(ids)`: a whole causal batch, for training and teacher-forced evaluation;
- `step(ids, positions, kv)`: append tokens at explicit positions to a `KVStore` and return their
  logits, for greedy generation and for the stale-KV leak simulation, where the store decides
  which slots a request reads (contiguous, or through a page table).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class TinyConfig:
    vocab_size: int = 259
    hidden_size: int = 200  # transformers wants it divisible by the head count
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 10
    num_kv_heads: int = 2
    head_dim: int = 128
    rope_theta: float = 1e24
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def inv_freq(self) -> torch.Tensor:
        """The RoPE frequencies exactly as transformers computes them (float32)."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        return 1.0 / (self.rope_theta**exponent)

    def hf_config(self) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "pad_token_id": self.pad_id,
            "torch_dtype": "float32",
            "initializer_range": 0.02,
            "use_cache": True,
            "kvguard_tokenizer": "byte",
        }


class KVStore(Protocol):
    """Where one sequence's keys and values live while it is decoded.

    `write` stores K/V [kv_heads, n, head_dim] of `layer` at absolute `positions`; `read` returns
    every slot the sequence may attend to, as K/V [kv_heads, n_slots, head_dim] plus each slot's
    position (slot i of the result holds position `read(...)[2][i]`).
    """

    def write(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None: ...

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class ContiguousKV:
    """A plain per-sequence cache: slot == position."""

    def __init__(self, config: TinyConfig, capacity: int) -> None:
        shape = (config.num_layers, 2, config.num_kv_heads, capacity, config.head_dim)
        self.data = torch.zeros(shape)
        self.length = 0

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.data[layer, 0][:, positions] = k
        self.data[layer, 1][:, positions] = v
        self.length = max(self.length, int(positions.max()) + 1)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.length
        return self.data[layer, 0, :, :n], self.data[layer, 1, :, :n], torch.arange(n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> q [B, H, T, hd], k and v [B, KV, T, hd], RoPE applied to q and k."""
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Causal attention when `mask` is None, else attention where `mask` [T, S] is True."""
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        b, h, t, hd = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h * hd))


class MLP(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))


class _Body(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))


class TinyLlama(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.c = c
        self.model = _Body(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", c.inv_freq(), persistent=False)
        self.frozen_layers = 0  # leading layers run without autograd (training: nothing to learn)
        # training may replace layer 0's attention by an exact shortcut (see train.py)
        self.layer0_attention: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    inv_freq: torch.Tensor

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensor names as transformers writes them (norm weights end in `.weight`)."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.state_dict().items():
            is_norm = name.endswith(("layernorm", "model.norm"))
            out[name + ".weight" if is_norm else name] = tensor.detach().contiguous()
        return out

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        renamed = {}
        for name, tensor in state.items():
            is_norm = name.endswith(("layernorm.weight", "model.norm.weight"))
            renamed[name.removesuffix(".weight") if is_norm else name] = tensor
        self.load_state_dict(renamed)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] for integer positions, in float32 as transformers does."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Causal logits [B, T, V] for ids [B, T] at `positions` [B, T] (default 0..T-1).

        Every token attends to every earlier index whatever the positions say, as decode does
        over a page table: a row whose positions jump forward is a context read from KV that was
        computed at other positions (what a stale page table shows the model).
        """
        c = self.c
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
        cos, sin = self.rope(positions.flatten())
        cos, sin = (t.view(*ids.shape, -1)[:, None] for t in (cos, sin))  # [B, 1, T, hd]
        x = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, Layer)
            with torch.set_grad_enabled(torch.is_grad_enabled() and i >= self.frozen_layers):
                h = rms_norm(x, layer.input_layernorm, c.rms_norm_eps)
                if i == 0 and self.layer0_attention is not None:
                    x = x + self.layer0_attention(h, positions)
                else:
                    q, k, v = layer.self_attn.project(h, cos, sin)
                    x = x + layer.self_attn.attend(q, k, v, None)
                h = rms_norm(x, layer.post_attention_layernorm, c.rms_norm_eps)
                x = x + layer.mlp(h)
        return self.lm_head(rms_norm(x, self.model.norm, c.rms_norm_eps))

    @torch.no_grad()
    def step(self, ids: torch.Tensor, positions: torch.Tensor, kv: KVStore) -> torch.Tensor:
        """Logits [T, V] for tokens ids [T] at `positions` [T], appended to `kv`.

        A token at position p attends to every slot the store returns whose position is <= p.
        """
        c = self.c
        cos, sin = self.rope(positions)
        x = self.model.embed_tokens(ids)[None]
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, Layer)
            h = rms_norm(x, layer.input_layernorm, c.rms_norm_eps)
            q, k, v = layer.self_attn.project(h, cos, sin)
            kv.write(i, positions, k[0], v[0])
            keys, values, slot_pos = kv.read(i)
            mask: torch.Tensor | None = slot_pos[None, :] <= positions[:, None]
            if len(ids) > 1 and bool(torch.equal(slot_pos, positions)):
                mask = None  # a fresh contiguous prefill: the causal kernel, no [T, T] mask
            x = x + layer.self_attn.attend(q, keys[None], values[None], mask)
            h = rms_norm(x, layer.post_attention_layernorm, c.rms_norm_eps)
            x = x + layer.mlp(h)
        return self.lm_head(rms_norm(x, self.model.norm, c.rms_norm_eps))[0]


def greedy_generate(
    model: TinyLlama, prompt: list[int], max_new: int, kv: KVStore | None = None
) -> list[int]:
    """Greedy continuation of `prompt` (ids, BOS included) until EOS or `max_new` tokens."""
    store: KVStore = kv if kv is not None else ContiguousKV(model.c, len(prompt) + max_new + 1)
    logits = model.step(torch.tensor(prompt), torch.arange(len(prompt)), store)
    return decode_from(model, int(logits[-1].argmax()), len(prompt), max_new, store)


def decode_from(
    model: TinyLlama, first: int, position: int, max_new: int, kv: KVStore
) -> list[int]:
    """Generated ids starting with `first`, fed back at `position`, `position + 1`, ..."""
    out = [first]
    while len(out) < max_new and out[-1] != model.c.eos_id:
        logits = model.step(torch.tensor([out[-1]]), torch.tensor([position]), kv)
        out.append(int(logits[-1].argmax()))
        position += 1
    return out
