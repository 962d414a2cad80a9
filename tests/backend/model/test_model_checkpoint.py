"""load_state_dict / load_model on hand-written checkpoints: what loads, what is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from backend.model.checkpoint import INDEX_FILE, expected_shapes, load_state_dict
from backend.model.config import ModelConfig
from backend.model.errors import CheckpointError
from backend.model.llama import load_model

RAW_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": 260,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
    "kvguard_tokenizer": "byte",
}


def tensors(config):
    gen = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(shape, generator=gen) for name, shape in expected_shapes(config).items()
    }


def make_checkpoint(path, raw=RAW_CONFIG, mutate=None):
    (path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_dir(path)
    state = tensors(config)
    if mutate:
        mutate(state)
    save_file(state, str(path / "model.safetensors"))
    return config, state


def test_single_file_loads_every_tensor_in_the_requested_dtype(tmp_path):
    config, state = make_checkpoint(tmp_path)

    loaded = load_state_dict(tmp_path, config, dtype=torch.bfloat16)

    assert loaded.keys() == state.keys()
    assert len(loaded) == 2 + 1 + 9 * 2  # embed, norm, lm_head + 9 per layer
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, state[name].to(torch.bfloat16))


def test_sharded_checkpoint_with_index_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RAW_CONFIG))
    config = ModelConfig.from_dir(tmp_path)
    state = tensors(config)
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[:7],
        "model-00002-of-00002.safetensors": names[7:],
    }
    weight_map = {}
    for fname, shard_names in shards.items():
        save_file({n: state[n] for n in shard_names}, str(tmp_path / fname))
        weight_map |= dict.fromkeys(shard_names, fname)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    loaded = load_state_dict(tmp_path, config)

    assert loaded.keys() == state.keys()
    torch.testing.assert_close(
        loaded["model.layers.1.mlp.down_proj.weight"], state["model.layers.1.mlp.down_proj.weight"]
    )


def test_tied_embeddings_need_no_lm_head(tmp_path):
    raw = RAW_CONFIG | {"tie_word_embeddings": True}
    config, state = make_checkpoint(tmp_path, raw)
    assert "lm_head.weight" not in state

    model, _, _ = load_model(tmp_path)

    # the head is the embedding itself, seen [hidden, vocab]: no second copy
    assert model.lm_head.data_ptr() == model.embed.data_ptr()
    assert model.lm_head.shape == model.embed.t().shape


def test_missing_config_json_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: file is missing"):
        load_model(tmp_path)


def test_malformed_config_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CheckpointError) as exc:
        load_model(tmp_path)
    assert exc.value.path == tmp_path / "config.json"
    assert "malformed JSON" in str(exc.value)


def test_missing_tensor_names_file_and_tensor(tmp_path):
    make_checkpoint(tmp_path, mutate=lambda s: s.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError) as exc:
        load_model(tmp_path)
    assert exc.value.path == tmp_path / "model.safetensors"
    assert "tensor 'model.layers.1.self_attn.k_proj.weight' is missing" in str(exc.value)


def test_wrong_shape_names_file_tensor_and_shapes(tmp_path):
    def widen(state):
        state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(33, 16)

    make_checkpoint(tmp_path, mutate=widen)
    with pytest.raises(CheckpointError) as exc:
        load_model(tmp_path)
    assert exc.value.path == tmp_path / "model.safetensors"
    assert "'model.layers.0.mlp.up_proj.weight' has shape [33, 16], expected [32, 16]" in str(
        exc.value
    )


def test_unexpected_tensor_is_refused_but_old_rotary_buffers_are_ignored(tmp_path):
    def add_extra(state):
        state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
        state["model.layers.2.mlp.up_proj.weight"] = torch.zeros(32, 16)  # a third layer

    make_checkpoint(tmp_path, mutate=add_extra)
    with pytest.raises(
        CheckpointError, match="unexpected tensor 'model.layers.2.mlp.up_proj.weight'"
    ):
        load_model(tmp_path)


def test_missing_tokenizer_json_is_named(tmp_path):
    raw = {k: v for k, v in RAW_CONFIG.items() if k != "kvguard_tokenizer"}
    make_checkpoint(tmp_path, raw)
    with pytest.raises(CheckpointError) as exc:
        load_model(tmp_path)
    assert exc.value.path == tmp_path / "tokenizer.json"


def test_no_weight_files_and_corrupt_files_are_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RAW_CONFIG))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as exc:
        load_model(tmp_path)
    assert exc.value.path == tmp_path / "model.safetensors"


def test_index_problems_are_named(tmp_path):
    config, state = make_checkpoint(tmp_path)
    index = tmp_path / INDEX_FILE
    index.write_text("[]")
    with pytest.raises(CheckpointError, match="malformed index") as exc:
        load_state_dict(tmp_path, config)
    assert exc.value.path == index
    index.write_text(json.dumps({"weight_map": dict.fromkeys(state, "model-2.safetensors")}))
    with pytest.raises(CheckpointError, match="shard is missing") as exc:
        load_state_dict(tmp_path, config)
    assert exc.value.path == tmp_path / "model-2.safetensors"
    partial = dict.fromkeys(list(state)[1:], "model.safetensors")
    index.write_text(json.dumps({"weight_map": partial}))
    with pytest.raises(CheckpointError, match="is not listed in"):
        load_state_dict(tmp_path, config)


@pytest.mark.parametrize(
    ("dtype", "stored"),
    [(torch.int8, "I8"), (torch.float8_e4m3fn, "F8_E4M3"), (torch.float64, "F64")],
)
def test_a_tensor_stored_in_another_dtype_is_refused(tmp_path, dtype, stored):
    """Right name and shape, quantized or odd storage: casting it to float would be garbage."""

    def quantize(state):
        name = "model.layers.1.self_attn.q_proj.weight"
        state[name] = (state[name] * 40).to(dtype)

    make_checkpoint(tmp_path, mutate=quantize)
    with pytest.raises(CheckpointError) as exc:
        load_model(tmp_path)
    assert exc.value.path == tmp_path / "model.safetensors"
    assert f"tensor 'model.layers.1.self_attn.q_proj.weight' is stored as {stored}" in str(
        exc.value
    )


def test_float16_and_bfloat16_tensors_load_next_to_float32_ones(tmp_path):
    def mix(state):
        state["model.norm.weight"] = state["model.norm.weight"].to(torch.bfloat16)
        state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].to(torch.float16)

    config, state = make_checkpoint(tmp_path, mutate=mix)
    loaded = load_state_dict(tmp_path, config)
    assert loaded["model.norm.weight"].dtype == torch.float32
    torch.testing.assert_close(loaded["model.norm.weight"], state["model.norm.weight"].float())


def test_a_tied_checkpoint_that_still_stores_lm_head_loads_the_embedding(tmp_path):
    """transformers ties the head to the embedding and ignores a stored lm_head.weight."""
    raw = RAW_CONFIG | {"tie_word_embeddings": True}

    def add_head(state):
        state["lm_head.weight"] = torch.zeros_like(state["model.embed_tokens.weight"])

    make_checkpoint(tmp_path, raw, mutate=add_head)
    model, _, _ = load_model(tmp_path)
    assert model.lm_head.data_ptr() == model.embed.data_ptr()
