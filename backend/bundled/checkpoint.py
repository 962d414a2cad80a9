"""Reading and writing `kvguard-tiny` in the Hugging Face LlamaForCausalLM layout.

A checkpoint directory holds `config.json` (LlamaForCausalLM fields plus
`"kvguard_tokenizer": "byte"`) and `model.safetensors` (standard tensor names, float32).
`transformers.LlamaForCausalLM.from_pretrained(dir)` and the engine's loader both read it.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from backend.bundled.modeling import TinyConfig, TinyLlama

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save_checkpoint(model: TinyLlama, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.c.hf_config()
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(model.hf_state_dict(), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})


def config_from_json(raw: dict[str, object]) -> TinyConfig:
    """The TinyConfig a config.json describes (only the fields this module's model has)."""
    fields = {
        "vocab_size": "vocab_size",
        "hidden_size": "hidden_size",
        "intermediate_size": "intermediate_size",
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads",
        "head_dim": "head_dim",
        "rope_theta": "rope_theta",
        "max_position_embeddings": "max_position_embeddings",
        "rms_norm_eps": "rms_norm_eps",
    }
    values = {name: raw[key] for name, key in fields.items()}
    return TinyConfig(**values)  # type: ignore[arg-type]  # values come from our own writer


def load_checkpoint(model_dir: Path) -> TinyLlama:
    """The module for a directory written by `save_checkpoint`, in eval mode."""
    raw = json.loads((model_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    model = TinyLlama(config_from_json(raw))
    model.load_hf_state_dict(load_file(str(model_dir / WEIGHTS_FILE)))
    model.eval()
    return model
