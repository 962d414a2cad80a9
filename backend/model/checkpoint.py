"""Loading decoder weights from local `*.safetensors` files (single file or sharded with an index).

Lifecycle: `load_state_dict(dir, config, device=..., dtype=...)` (1) locates the weight files
(`model.safetensors.index.json` when present, else every `*.safetensors` in the directory),
(2) lists every tensor name, shape and stored dtype in them without reading data, (3) compares
against the names and shapes `config` implies and refuses any missing, unexpected, duplicated,
wrong-shape or non-float (int8, float8, ... : quantized) tensor with a `CheckpointError` naming
the file and the tensor, and only then (4) reads the tensors, converted to `dtype` on `device`.
Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from backend.model.config import ModelConfig
from backend.model.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
# Buffers some older transformers versions saved; they are recomputed from rope_theta.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Stored dtypes read as they are (converted exactly or rounded to the compute dtype).
FLOAT_DTYPES = ("F32", "F16", "BF16")
TIED_HEAD = "lm_head.weight"  # a tied checkpoint may still store it; transformers ignores it


@dataclass(frozen=True, slots=True)
class _StoredTensor:
    file: Path
    shape: tuple[int, ...]
    dtype: str


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a HF Llama/Mistral/Qwen2/Qwen3/Gemma 3/Phi-3 causal LM checkpoint
    with its shape."""
    hidden = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        shapes |= _layer_shapes(config, f"model.layers.{i}.")
    return shapes


def _layer_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        p + "self_attn.o_proj.weight": (hidden, q_out),
        p + "mlp.down_proj.weight": (hidden, inter),
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
    }
    if config.fused_checkpoint:  # Phi-3
        shapes[p + "self_attn.qkv_proj.weight"] = (q_out + 2 * kv_out, hidden)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, hidden)
    else:
        shapes |= {
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
        }
    if config.qkv_bias:
        shapes |= {
            p + "self_attn.q_proj.bias": (q_out,),
            p + "self_attn.k_proj.bias": (kv_out,),
            p + "self_attn.v_proj.bias": (kv_out,),
        }
    if config.o_bias:
        shapes[p + "self_attn.o_proj.bias"] = (hidden,)
    if config.qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
    if config.gemma:
        shapes[p + "pre_feedforward_layernorm.weight"] = (hidden,)
        shapes[p + "post_feedforward_layernorm.weight"] = (hidden,)
    return shapes


def load_state_dict(
    checkpoint_dir: Path | str,
    config: ModelConfig,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """All tensors of `expected_shapes(config)`, validated first, then read (see module doc)."""
    directory = Path(checkpoint_dir)
    files, listed_in = _weight_files(directory)
    stored = _list_tensors(files, listed_in)
    # A missing tensor is reported against the file that should have listed it.
    if listed_in is not None:
        missing_place = directory / INDEX_FILE
    else:
        missing_place = files[0] if len(files) == 1 else directory
    expected = expected_shapes(config)
    if config.tie_word_embeddings and TIED_HEAD in stored:
        expected[TIED_HEAD] = expected["model.embed_tokens.weight"]  # checked, then not read
    _validate(stored, expected, missing_place)
    if config.tie_word_embeddings:
        stored.pop(TIED_HEAD, None)
    return _read(stored, torch.device(device), dtype)


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The files to open and, for a sharded checkpoint, the index's tensor -> file map."""
    if not directory.is_dir():
        raise CheckpointError(directory, "checkpoint directory does not exist")
    index = directory / INDEX_FILE
    if not index.is_file():
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(directory, "no *.safetensors file in the checkpoint directory")
        return files, None
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(
            index, f"malformed index (needs a 'weight_map' object): {exc}"
        ) from exc
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(index, "'weight_map' must map tensor names to file names")
    listed = {name: directory / fname for name, fname in weight_map.items()}
    for name, path in listed.items():
        if not path.is_file():
            raise CheckpointError(path, f"shard is missing (index lists tensor '{name}' in it)")
    return sorted(set(listed.values())), listed


def _list_tensors(files: list[Path], listed_in: dict[str, Path] | None) -> dict[str, _StoredTensor]:
    stored: dict[str, _StoredTensor] = {}
    for path in files:
        for name, (shape, dtype) in _file_tensors(path).items():
            if name in stored:
                raise CheckpointError(
                    path, f"tensor '{name}' is also stored in {stored[name].file}"
                )
            if listed_in is not None and listed_in.get(name) != path:
                raise CheckpointError(path, f"tensor '{name}' is not listed in {INDEX_FILE}")
            stored[name] = _StoredTensor(path, shape, dtype)
    for name, path in (listed_in or {}).items():
        if name not in stored:
            raise CheckpointError(path, f"tensor '{name}' is listed in the index but not stored")
    return stored


def _file_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, stored dtype) of every tensor in one file, without reading the data."""
    if path.is_symlink() and not path.exists():
        raise CheckpointError(path, "is a link to a missing file (an incomplete download?)")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118
            return {n: (tuple(s.get_shape()), str(s.get_dtype())) for n, s in slices.items()}
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(path, f"not a readable safetensors file: {exc}") from exc


def _validate(
    stored: dict[str, _StoredTensor], expected: dict[str, tuple[int, ...]], missing_place: Path
) -> None:
    for name, shape in expected.items():
        if name not in stored:
            raise CheckpointError(missing_place, f"tensor '{name}' is missing")
        if stored[name].dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                stored[name].file,
                f"tensor '{name}' is stored as {stored[name].dtype}; only "
                f"{', '.join(FLOAT_DTYPES)} are supported (quantized checkpoints are not)",
            )
        if stored[name].shape != shape:
            raise CheckpointError(
                stored[name].file,
                f"tensor '{name}' has shape {list(stored[name].shape)}, expected {list(shape)}",
            )
    for name, item in stored.items():
        if name not in expected and not name.endswith(_IGNORED_SUFFIXES):
            raise CheckpointError(item.file, f"unexpected tensor '{name}'")


def _read(
    stored: dict[str, _StoredTensor], device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name, item in stored.items():
        if not name.endswith(_IGNORED_SUFFIXES):
            by_file.setdefault(item.file, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return out
