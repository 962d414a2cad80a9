"""Chat templates: how a list of messages becomes the prompt text a checkpoint was trained on.

Chosen per checkpoint at start-up (`load_chat_renderer`):
- byte-tokenizer checkpoints: the bundled model's own format (``backend.bundled.chat``), encoded
  with BOS like any prompt;
- otherwise the Jinja template transformers would use (`backend.model.tokenizer_config` says where
  it is found), rendered the way ``apply_chat_template`` renders it: a sandboxed environment
  with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` that
  keeps non-ASCII text, ``raise_exception`` and ``strftime_now``, the ``{% generation %}`` tag,
  every named special token (``bos_token``, ``eos_token``, ...) as a variable, messages with
  null fields dropped, ``add_generation_prompt=True``. The text carries its own special tokens,
  so it is encoded without adding any (as transformers does). With named templates, "default"
  is used ("tool_use" when tools are given). The template's text also tells how the checkpoint
  writes tool calls (``backend.model.tool_calls.detect``);
- a checkpoint with no template gets none: a chat request is a clear 400 (transformers refuses
  too), never a made-up transcript.

Every template is compiled and rendered once on a one-message conversation at start-up; a template
that fails there refuses the start (`CheckpointError` naming the file), so it can never turn every
chat request into a 500. At request time a template that rejects the conversation (e.g.
``raise_exception('Conversation roles must alternate ...')``) raises `ChatTemplateRefused`, which
the server answers with a 400 carrying the template's message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from backend.model.config import BYTE_TOKENIZER, ModelConfig
from backend.model.errors import CheckpointError
from backend.model.tokenizer_config import ChatTemplateSource, TokenizerFiles
from backend.model.tool_calls import HERMES, ToolCallFormat, detect

Messages = Sequence[Mapping[str, Any]]
PROBE: list[dict[str, Any]] = [{"role": "user", "content": "Hello"}]


class ChatTemplateRefused(ValueError):
    """The conversation cannot be rendered by this checkpoint's template (the client's input)."""


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """A checkpoint's chat format; calling it renders a conversation (see the module doc)."""

    origin: str  # where the template came from, for logs and errors
    special_tokens_in_text: bool  # encode the rendered text without adding special tokens
    _render: Callable[[Messages, Any], str] = field(repr=False)
    tool_format: ToolCallFormat = HERMES  # how the template writes tool calls

    def __call__(self, messages: Messages, tools: Any = None) -> str:
        return self._render(messages, tools)


def load_chat_renderer(checkpoint_dir: Path | str, config: ModelConfig) -> ChatFormat:
    if config.kvguard_tokenizer == BYTE_TOKENIZER:
        from backend.bundled import chat

        return ChatFormat("kvguard-tiny chat format", False, chat.render)
    files = TokenizerFiles.read(checkpoint_dir)
    if not files.templates:
        return ChatFormat("none", True, _no_template)
    if "default" not in files.templates:
        any_source = next(iter(files.templates.values()))
        raise CheckpointError(
            any_source.path,
            f"chat templates are named {sorted(files.templates)} but none is 'default'",
        )
    compiled = {name: _compile(source) for name, source in files.templates.items()}
    variables = dict(files.special_tokens)

    def render(messages: Messages, tools: Any) -> str:
        name = "tool_use" if tools and "tool_use" in compiled else "default"
        return _render(compiled[name], messages, tools, variables)

    for name, source in files.templates.items():
        _probe(source, compiled[name], variables)
    texts = " ".join(source.text for source in files.templates.values())
    return ChatFormat(_describe(files.templates["default"]), True, render, detect(texts))


def countable_tokenizer(config: ModelConfig) -> str | None:
    """The id a client may count prompts under itself (`backend.bundled.chat.count_tokens`):
    only the byte tokenizer with the bundled format qualifies; other checkpoints say None."""
    if config.kvguard_tokenizer == BYTE_TOKENIZER:
        from backend.bundled import chat

        return chat.TOKENIZER_ID
    return None


def _no_template(messages: Messages, tools: Any) -> str:
    raise ChatTemplateRefused(
        "this model has no chat template (no chat_template.jinja, no chat_template in "
        "tokenizer_config.json); send a prompt to /v1/completions instead"
    )


def _describe(source: ChatTemplateSource) -> str:
    return f"{source.path.name} ({source.name!r})"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _compile(source: ChatTemplateSource) -> Any:
    try:
        return _environment().from_string(source.text)
    except Exception as exc:  # jinja2 raises TemplateSyntaxError and friends
        raise CheckpointError(
            source.path, f"chat template {source.name!r} does not compile: {_one_line(exc)}"
        ) from exc


def _probe(source: ChatTemplateSource, template: Any, variables: dict[str, str]) -> None:
    try:
        text = _render(template, PROBE, None, variables)
    except ChatTemplateRefused as exc:
        raise CheckpointError(
            source.path,
            f"chat template {source.name!r} fails on a one-message conversation "
            f"[{{'role': 'user', 'content': 'Hello'}}]: {exc}",
        ) from exc
    if not text:
        raise CheckpointError(source.path, f"chat template {source.name!r} renders nothing")


def _render(template: Any, messages: Messages, tools: Any, variables: dict[str, str]) -> str:
    plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return str(
            template.render(
                messages=plain,
                tools=tools,
                documents=None,
                add_generation_prompt=True,
                **variables,
            )
        )
    except Exception as exc:  # raise_exception, undefined names, type errors on odd input
        raise ChatTemplateRefused(_one_line(exc)) from exc


def _environment() -> Any:
    """A sandboxed Jinja environment that renders templates as transformers does."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _generation_tag()],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _generation_tag() -> type:
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks):
    rendered as its body, as transformers does when it is not collecting the mask."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return Generation
