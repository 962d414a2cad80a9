"""Chat templates: how a list of messages becomes the prompt text a checkpoint was trained on.

Chosen per checkpoint at start-up: the bundled model's own format (``backend.bundled.chat``) for
byte-tokenizer checkpoints, the Jinja ``chat_template`` of ``tokenizer_config.json`` when the
checkpoint ships one, else a plain ``role: content`` transcript ending with the assistant cue.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from backend.model.config import BYTE_TOKENIZER, ModelConfig
from backend.model.errors import CheckpointError

ChatRenderer = Callable[[Sequence[Mapping[str, str]]], str]


def plain_transcript(messages: Sequence[Mapping[str, str]]) -> str:
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant: "])


def load_chat_renderer(checkpoint_dir: Path | str, config: ModelConfig) -> ChatRenderer:
    if config.kvguard_tokenizer == BYTE_TOKENIZER:
        from backend.bundled import chat

        return chat.render
    path = Path(checkpoint_dir) / "tokenizer_config.json"
    if not path.is_file():
        return plain_transcript
    try:
        template = json.loads(path.read_text()).get("chat_template")
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"unreadable: {exc}") from exc
    if not isinstance(template, str):
        return plain_transcript
    return _jinja_renderer(template)


def countable_tokenizer(config: ModelConfig) -> str | None:
    """The id a client may count prompts under itself (`backend.bundled.chat.count_tokens`):
    only the byte tokenizer with the bundled format qualifies; other checkpoints say None."""
    if config.kvguard_tokenizer == BYTE_TOKENIZER:
        from backend.bundled import chat

        return chat.TOKENIZER_ID
    return None


def _jinja_renderer(template: str) -> ChatRenderer:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    compiled = ImmutableSandboxedEnvironment().from_string(template)

    def render(messages: Sequence[Mapping[str, str]]) -> str:
        return compiled.render(messages=list(messages), add_generation_prompt=True)

    return render
