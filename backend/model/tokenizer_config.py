"""A checkpoint's tokenizer files beyond `tokenizer.json`: special tokens and chat templates.

Read as transformers (v5) reads them, from local files only:
- special tokens (``bos_token``, ``eos_token``, ...): ``tokenizer_config.json``, overridden by the
  legacy ``special_tokens_map.json`` when the config predates ``added_tokens_decoder``. A value
  is a string or a serialized AddedToken (``{"content": ...}``).
- chat templates, highest priority first: ``chat_template.jinja`` (transformers >= 4.43 saves a
  single template there) plus ``additional_chat_templates/<name>.jinja``; else the
  ``chat_template`` entry of ``tokenizer_config.json``, a string or a list of
  ``{"name", "template"}``. A file template is named "default".

- ``split_special_tokens`` (``tokenizer_config.json``, default false): when true, special tokens
  written in a text are encoded as ordinary text, in prompts and rendered chats alike (transformers
  sets its tokenizer's ``encode_special_tokens`` from it): a user who types ``<|im_end|>`` does not
  end a turn where the checkpoint's operator asked for that.

`TokenizerFiles.read(dir)` checks types and names the file and field of any problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.model.config import read_json_object
from backend.model.errors import CheckpointError

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# The named special tokens transformers passes to every chat template.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True, slots=True)
class ChatTemplateSource:
    name: str
    text: str
    path: Path  # the file it came from (for errors)


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    special_tokens: dict[str, str]  # named special token -> its text
    templates: dict[str, ChatTemplateSource]  # by name; empty when the checkpoint has none
    split_special_tokens: bool = False

    @classmethod
    def read(cls, checkpoint_dir: Path | str) -> TokenizerFiles:
        directory = Path(checkpoint_dir)
        config_path = directory / TOKENIZER_CONFIG_FILE
        config = read_json_object(directory, config_path, required=False) or {}
        specials = _special_tokens(config, config_path)
        if "added_tokens_decoder" not in config:
            legacy_path = directory / SPECIAL_TOKENS_MAP_FILE
            legacy = read_json_object(directory, legacy_path, required=False) or {}
            specials |= _special_tokens(legacy, legacy_path)
        templates = _file_templates(directory) or _config_templates(config, config_path)
        split = config.get("split_special_tokens", False)
        if not isinstance(split, bool):
            raise CheckpointError(
                config_path, "field 'split_special_tokens': expected true or false"
            )
        return cls(specials, templates, split)


def _special_tokens(raw: dict[str, Any], path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in NAMED_SPECIAL_TOKENS:
        value = raw.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise CheckpointError(path, f"field '{key}': expected a string, got {value!r}")
        out[key] = value
    return out


def _file_templates(directory: Path) -> dict[str, ChatTemplateSource]:
    files: dict[str, Path] = {}
    if (directory / CHAT_TEMPLATE_FILE).exists() or (directory / CHAT_TEMPLATE_FILE).is_symlink():
        files["default"] = directory / CHAT_TEMPLATE_FILE
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path
    out = {}
    for name, path in files.items():
        try:
            out[name] = ChatTemplateSource(name, path.read_text(encoding="utf-8"), path)
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(path, f"unreadable chat template: {exc}") from exc
    return out


def _config_templates(config: dict[str, Any], path: Path) -> dict[str, ChatTemplateSource]:
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": ChatTemplateSource("default", value, path)}
    entries = value if isinstance(value, list) else [None]
    out = {}
    for entry in entries:
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("template"), str)
        ):
            raise CheckpointError(
                path,
                "field 'chat_template': expected a string or a list of "
                '{"name": ..., "template": ...} objects',
            )
        out[entry["name"]] = ChatTemplateSource(entry["name"], entry["template"], path)
    return out
