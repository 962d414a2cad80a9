"""ModelConfig.from_dir: both transformers spellings, and a CheckpointError for every bad field."""

from __future__ import annotations

import json

import pytest

from backend.model.config import ModelConfig
from backend.model.errors import CheckpointError

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_reads_transformers_v4_spelling(tmp_path):
    raw = BASE | {"rope_theta": 500000, "torch_dtype": "bfloat16", "rope_scaling": None}

    config = ModelConfig.from_dir(write(tmp_path, raw))

    assert config.rope_theta == 500000.0
    assert config.torch_dtype == "bfloat16"
    assert config.head_dim == 16  # hidden / heads when absent
    assert config.num_query_groups == 2
    assert config.eos_token_ids == (2,)
    assert config.kvguard_tokenizer is None


def test_reads_transformers_v5_spelling_and_byte_tokenizer(tmp_path):
    raw = BASE | {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "dtype": "float32",
        "head_dim": 32,
        "eos_token_id": [257, 2],
        "bos_token_id": None,
        "kvguard_tokenizer": "byte",
    }

    config = ModelConfig.from_dir(write(tmp_path, raw))

    assert (config.rope_theta, config.torch_dtype, config.head_dim) == (10000.0, "float32", 32)
    assert config.eos_token_ids == (257, 2)
    assert config.bos_token_id is None
    assert config.kvguard_tokenizer == "byte"


def test_missing_kv_heads_means_multi_head_attention(tmp_path):
    raw = {k: v for k, v in BASE.items() if k != "num_key_value_heads"} | {"rope_theta": 1e4}
    assert ModelConfig.from_dir(write(tmp_path, raw)).num_key_value_heads == 4


def test_missing_directory_and_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist") as exc:
        ModelConfig.from_dir(tmp_path / "nope")
    assert exc.value.path == tmp_path / "nope"
    with pytest.raises(CheckpointError, match="config.json: file is missing"):
        ModelConfig.from_dir(tmp_path)


def test_malformed_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(CheckpointError, match="config.json: malformed JSON") as exc:
        ModelConfig.from_dir(tmp_path)
    assert exc.value.path == tmp_path / "config.json"


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ({"hidden_size": None}, "hidden_size", "expected an integer"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers", "expected an integer"),
        ({"num_hidden_layers": True}, "num_hidden_layers", "expected an integer"),
        ({"vocab_size": 0}, "vocab_size", "must be positive"),
        ({"rms_norm_eps": "small"}, "rms_norm_eps", "expected a number"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings", "expected true or false"),
        ({"eos_token_id": "</s>"}, "eos_token_id", "expected an integer or a list"),
        ({"eos_token_id": []}, "eos_token_id", "expected an integer or a list"),
        ({"eos_token_id": 300}, "eos_token_id", "outside the vocabulary"),
        ({"bos_token_id": -1}, "bos_token_id", "non-negative"),
        ({"torch_dtype": "float64"}, "torch_dtype", "expected one of"),
        ({"num_key_value_heads": 3}, "num_key_value_heads", "does not divide"),
        ({"architectures": ["MixtralForCausalLM"]}, "architectures", "only"),
        ({"architectures": ["LlamaForCausalLM", "X"]}, "architectures", "only"),
        ({"architectures": "LlamaForCausalLM"}, "architectures", "list of strings"),
        ({"hidden_act": "gelu"}, "hidden_act", "silu"),
        ({"attention_bias": "yes"}, "attention_bias", "expected true or false"),
        ({"kvguard_tokenizer": "sentencepiece"}, "kvguard_tokenizer", "only 'byte'"),
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
            "rope_scaling.short_factor",
            "expected 8 positive numbers",
        ),
        ({"rope_scaling": {"rope_type": "dynamic"}}, "rope_scaling.factor", "is missing"),
        ({"rope_scaling": {"rope_type": "mrope"}}, "rope_scaling", "not supported"),
        ({"architectures": ["Gemma2ForCausalLM"]}, "architectures", "only"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "architectures", "only"),
        (
            {
                "architectures": ["Gemma3ForCausalLM"],
                "model_type": "gemma3_text",
                "hidden_act": "silu",
            },
            "hidden_act",
            "gelu_pytorch_tanh",
        ),
        (
            {
                "architectures": ["Gemma3ForCausalLM"],
                "model_type": "gemma3_text",
                "hidden_act": "gelu_pytorch_tanh",
                "final_logit_softcapping": 30.0,
            },
            "final_logit_softcapping",
            "soft-capping",
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling.low_freq_factor",
            "is missing",
        ),
        ({"rope_parameters": {"rope_type": "ntk", "rope_theta": 1e4}}, "rope_parameters", "only"),
    ],
)
def test_bad_fields_name_file_and_field(tmp_path, change, field, problem):
    raw = BASE | {"rope_theta": 10000.0} | change
    with pytest.raises(CheckpointError) as exc:
        ModelConfig.from_dir(write(tmp_path, raw))
    assert exc.value.path == tmp_path / "config.json"
    assert f"field '{field}'" in str(exc.value)
    assert problem in str(exc.value)


@pytest.mark.parametrize(
    "field", ["hidden_size", "intermediate_size", "vocab_size", "architectures", "eos_token_id"]
)
def test_missing_required_field_is_named(tmp_path, field):
    raw = {k: v for k, v in (BASE | {"rope_theta": 1e4}).items() if k != field}
    with pytest.raises(CheckpointError, match=f"field '{field}': is missing"):
        ModelConfig.from_dir(write(tmp_path, raw))


def test_missing_rope_theta_takes_the_transformers_default(tmp_path):
    assert ModelConfig.from_dir(write(tmp_path, BASE)).rope_theta == 10000.0


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        # transformers builds MistralForCausalLM from model_type: a Llama here would be wrong
        ({"model_type": "mistral", "sliding_window": 16}, "model_type", "does not match"),
        # LlamaForCausalLM has no sliding window: transformers ignores it, the author did not
        ({"model_type": "llama", "sliding_window": 16}, "sliding_window", "LlamaForCausalLM"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config", "quantized"),
        ({"mlp_bias": True}, "mlp_bias", "not supported"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor", "not supported"),
    ],
)
def test_fields_that_would_change_the_arithmetic_are_refused(tmp_path, change, field, problem):
    raw = BASE | {"rope_theta": 10000.0} | change
    with pytest.raises(CheckpointError) as exc:
        ModelConfig.from_dir(write(tmp_path, raw))
    assert f"field '{field}'" in str(exc.value)
    assert problem in str(exc.value)


def test_llama3_rope_in_both_spellings(tmp_path):
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    v4 = BASE | {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **llama3}}
    v5 = BASE | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **llama3}}
    a = ModelConfig.from_dir(write(tmp_path, v4))
    b = ModelConfig.from_dir(write(tmp_path, v5))
    assert a.rope_theta == b.rope_theta == 500000.0
    assert a.rope_scaling == b.rope_scaling
    assert a.rope_scaling is not None
    # absent, original_max_position_embeddings falls back to max_position_embeddings (transformers)
    assert a.rope_scaling.original_max_position_embeddings == BASE["max_position_embeddings"]


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        ({}, (4096, 4096)),  # absent: MistralConfig's default
        ({"sliding_window": None}, ()),  # null: none (Mistral 7B v0.2+)
        ({"sliding_window": 32}, (32, 32)),
    ],
)
def test_mistral_windows_follow_transformers_defaults(tmp_path, fields, windows):
    raw = BASE | {"architectures": ["MistralForCausalLM"], "model_type": "mistral"} | fields
    config = ModelConfig.from_dir(write(tmp_path, raw))
    assert tuple(w for w in config.layer_windows if w is not None) == windows


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        ({"use_sliding_window": False, "sliding_window": 4096}, ()),  # Qwen2.5's shipped configs
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, (None, 64)),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 64,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            (64, None),
        ),
    ],
)
def test_qwen2_windows_per_layer(tmp_path, fields, windows):
    raw = BASE | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"} | fields
    config = ModelConfig.from_dir(write(tmp_path, raw))
    assert config.layer_windows == windows
    assert (config.qkv_bias, config.o_bias) == (True, False)
