"""What the engine serves for a real-style checkpoint, held against transformers in-process.

The engine's service is built as the server builds it (``build_engine`` + ``make_service``) and
asked what a request would get: prompt token ids, the rendered chat, the stop tokens. The answer
must be what transformers' ``AutoTokenizer`` gives for the same directory (``tokenizer(prompt)``,
``apply_chat_template``, ``generation_config``), and a chat template that cannot render is
refused at start-up, never at request time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers
from tiny_families import (
    CONVERSATIONS,
    LLAMA3_TEMPLATE,
    PROMPTS,
    QWEN2_TEMPLATE,
    SMOLLM_TEMPLATE,
)

from backend.config import BackendSettings
from backend.core.errors import InvalidRequest
from backend.engine.build import build_engine
from backend.model.chat import load_chat_renderer
from backend.model.config import ModelConfig
from backend.model.errors import CheckpointError
from backend.server.openai_schema import ChatMessage
from backend.server.roles import make_service
from backend.server.service import EngineService
from contracts.engine import Role


def service_for(path: Path) -> EngineService:
    settings = BackendSettings(model=path, pool_tokens=512, page_size=16)
    return make_service(build_engine(settings), settings, Role.UNIFIED)


def variant(family_checkpoint, tmp_path: Path, name: str, **edits) -> Path:
    """A copy of a family checkpoint with some files rewritten (``None`` deletes a file).

    ``tokenizer_config``/``config``/``generation_config`` are dict updates of those JSON files."""
    path = tmp_path / f"{name}-variant"
    shutil.copytree(family_checkpoint(name), path)
    for stem in ("tokenizer_config", "config", "generation_config"):
        if stem in edits:
            file = path / f"{stem}.json"
            file.write_text(json.dumps(json.loads(file.read_text()) | edits.pop(stem)))
    for fname, text in edits.get("files", {}).items():
        if text is None:
            (path / fname).unlink()
        else:
            (path / fname).parent.mkdir(exist_ok=True)
            (path / fname).write_text(text)
    return path


def hf_chat(path: Path, messages, **kw):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return tok.apply_chat_template(messages, add_generation_prompt=True, **kw)


def render(path: Path, messages) -> str:
    return load_chat_renderer(path, ModelConfig.from_dir(path))(messages)


# -- 1. BOS comes from the tokenizer, not from config.json -------------------------------------


@pytest.mark.parametrize(
    ("family", "config_edit"),
    [
        ("smollm", {}),  # config.json names bos_token_id 1; the GPT-2 tokenizer adds none
        ("llama2", {"bos_token_id": None}),  # config says no BOS; the tokenizer adds <s>
    ],
)
def test_prompt_tokens_are_what_the_tokenizer_adds(
    family_checkpoint, tmp_path, family, config_edit
):
    path = variant(family_checkpoint, tmp_path, family, config=config_edit)
    service = service_for(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)

    for prompt in PROMPTS:
        assert service.encode_prompt(prompt) == hf(prompt)["input_ids"], prompt


# -- 2. where transformers finds the template --------------------------------------------------


def test_chat_template_jinja_file_is_used(family_checkpoint, tmp_path):
    # transformers >= 4.43 saves the template as chat_template.jinja, not in tokenizer_config.json
    path = variant(
        family_checkpoint,
        tmp_path,
        "smollm",
        tokenizer_config={"chat_template": None},
        files={"chat_template.jinja": SMOLLM_TEMPLATE},
    )
    for messages in CONVERSATIONS:
        assert render(path, messages) == hf_chat(path, messages, tokenize=False)


def test_named_template_list_uses_default(family_checkpoint, tmp_path):
    named = [
        {"name": "tool_use", "template": "{{ 'tools: ' + messages[0]['content'] }}"},
        {"name": "default", "template": SMOLLM_TEMPLATE},
    ]
    path = variant(family_checkpoint, tmp_path, "smollm", tokenizer_config={"chat_template": named})
    for messages in CONVERSATIONS:
        assert render(path, messages) == hf_chat(path, messages, tokenize=False)


def test_additional_templates_directory_and_jinja_file_outrank_the_config(
    family_checkpoint, tmp_path
):
    path = variant(
        family_checkpoint,
        tmp_path,
        "smollm",
        tokenizer_config={"chat_template": "{{ 'stale config template' }}"},
        files={
            "chat_template.jinja": SMOLLM_TEMPLATE,
            "additional_chat_templates/tool_use.jinja": "{{ 'tools' }}",
        },
    )
    messages = CONVERSATIONS[1]
    assert render(path, messages) == hf_chat(path, messages, tokenize=False)
    assert "stale" not in render(path, messages)


# -- 3. transformers' Jinja environment: trim_blocks and lstrip_blocks --------------------------


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, QWEN2_TEMPLATE], ids=["trim", "lstrip"])
def test_block_whitespace_is_handled_as_transformers_does(family_checkpoint, tmp_path, template):
    path = variant(
        family_checkpoint, tmp_path, "smollm", tokenizer_config={"chat_template": template}
    )
    for messages in CONVERSATIONS:
        assert render(path, messages) == hf_chat(path, messages, tokenize=False)


# -- 6. templates get the special tokens and raise_exception; broken ones refuse to start ------


def test_llama2_template_gets_bos_eos_and_raise_exception(family_checkpoint):
    path = family_checkpoint("llama2")
    for messages in CONVERSATIONS:
        assert render(path, messages) == hf_chat(path, messages, tokenize=False)


def test_a_template_refusing_the_conversation_is_a_client_error(family_checkpoint, tmp_path):
    path = variant(
        family_checkpoint,
        tmp_path,
        "smollm",
        tokenizer_config={
            "chat_template": "{% if messages[0]['role'] == 'system' %}"
            "{{ raise_exception('System role not supported') }}{% endif %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        },
    )
    service = service_for(path)
    with pytest.raises(InvalidRequest, match="System role not supported"):
        service.render_chat(
            [ChatMessage(role="system", content="x"), ChatMessage(role="user", content="y")]
        )


@pytest.mark.parametrize(
    "template",
    [
        "{{ bos_tokn + messages[0]['content'] }}",  # a typo: undefined on every request
        "{% for m in messages %}{{ m['content'] }}",  # does not compile
        "{{ raise_exception('this template is for tools only') }}",
    ],
    ids=["undefined", "syntax", "raises"],
)
def test_a_template_that_cannot_render_refuses_start_up(family_checkpoint, tmp_path, template):
    path = variant(
        family_checkpoint, tmp_path, "smollm", tokenizer_config={"chat_template": template}
    )
    with pytest.raises(CheckpointError, match="tokenizer_config.json: chat template"):
        build_engine(BackendSettings(model=path, pool_tokens=512, page_size=16))


# -- 8. end-of-turn ids from generation_config.json stop generation -----------------------------


def test_generation_config_end_of_turn_ids_are_stop_tokens(family_checkpoint, tmp_path):
    # SmolLM-style: config.json ends on <|im_end|> (2); generation_config adds <|endoftext|> (0)
    path = variant(
        family_checkpoint, tmp_path, "smollm", generation_config={"eos_token_id": [2, 0]}
    )
    service = service_for(path)
    assert {0, 2} <= service.tokenizer.stop_ids


def test_a_checkpoint_without_a_template_answers_chat_with_a_client_error(
    family_checkpoint, tmp_path
):
    """transformers refuses too; a made-up `role: content` transcript is not what the model saw."""
    path = variant(family_checkpoint, tmp_path, "smollm", tokenizer_config={"chat_template": None})
    service = service_for(path)
    assert service.encode_prompt("Hello") == service.tokenizer.encode("Hello")  # prompts work
    with pytest.raises(InvalidRequest, match="no chat template"):
        service.render_chat([ChatMessage(role="user", content="Hello")])
