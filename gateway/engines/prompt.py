"""What an engine's tokenize route must be sent to count a request's prompt as its chat route
renders it.

A chat's prompt is more than its messages: the chat template also writes the request's tool
definitions and, for some models, the tool choice, the response format and a thinking switch.
Admission counts the prompt on the engine's own tokenize route (``EngineAdapter.count_tokens``),
so that route is sent every field that changes the rendering, in the form it takes it. Per kind,
checked against the released sources:

- **vLLM** (0.33.0) ``POST /tokenize``, ``TokenizeChatRequest`` (``serve/tokenize/protocol.py``)
  renders ``messages`` with ``tools`` and ``chat_template_kwargs`` and ignores any other field.
  The chat route (``renderers/online_renderer.py`` ``render_chat``) renders the request's tools
  (all of them, also for ``tool_choice: "none"`` unless the server runs with
  ``--exclude-tools-when-tool-choice-none``, where counting them overcounts) and the template
  variables ``ChatCompletionRequest.build_chat_params`` derives: ``reasoning_effort`` and
  ``enable_thinking`` (false for effort "none"). The Kimi K3 renderer (``renderers/kimi_k3.py``)
  also passes ``tool_choice`` (with tools, unless "auto") and ``response_format`` as template
  variables, dumped from vLLM's own request classes; ``vllm_template_kwargs`` sends all of these
  as ``chat_template_kwargs``. The HF renderer drops a kwarg its template does not declare
  (``resolve_chat_template_kwargs``): exact there, and an overcount for a template that declares
  ``tool_choice`` or ``response_format`` (its chat route never passes them). Not seen by the
  gateway: a server's ``--reasoning-effort-map``, which renames the effort before the template
  sees it; the count then holds the requested level's name.
- **SGLang** (0.5.12 to 0.5.23) ``/v1/tokenize`` and ``/tokenize``, ``TokenizeRequest``
  (``entrypoints/openai/protocol.py``) keeps unknown fields and renders ``messages`` as a chat
  completion of the whole request (``to_chat_completion_request``, ``serving_tokenize.py``): the
  same code path as the chat route, so the body the engine will get is sent as it is (tools, none
  for ``tool_choice: "none"``, only the named one; the Kimi K3 variables; reasoning effort).
  Releases before 0.5.12 count prompt strings only: a chat cannot be counted there and is refused
  (502 ``token_count_unavailable``), never admitted on a guess.
- **bundled** ``/tokenize``: the messages (tool turns and assistant calls included) and the
  ``tools``, which its chat template renders (whatever the ``tool_choice``); ``tool_choice`` and
  ``response_format`` are not written into the prompt (the engine constrains sampling with them),
  and ``reasoning_effort`` is refused at the door (``gateway.openai.surface``).
- **declared** (OpenAI-compatible servers, litellm providers): counted in the gateway, an upper
  bound over the messages and ``DEFINITIONS`` (``gateway.engines.provider_count``).
"""

from __future__ import annotations

from typing import Any

# Request fields a provider writes into the prompt beside the messages.
DEFINITIONS = ("tools", "functions", "tool_choice", "function_call", "response_format")
NOT_RENDERED = ("stream", "stream_options")  # SGLang: no effect on the prompt, not sent to count


def plain(model: str, body: dict[str, Any]) -> dict[str, Any]:
    """The messages of a chat, or a completion's prompt."""
    if "messages" in body:
        return {"model": model, "messages": body["messages"]}
    return {"model": model, "prompt": body.get("prompt") or ""}


def for_bundled(model: str, body: dict[str, Any]) -> dict[str, Any]:
    request = plain(model, body)
    if "messages" in request and body.get("tools"):
        request["tools"] = body["tools"]
    return request


def for_vllm(model: str, body: dict[str, Any]) -> dict[str, Any]:
    request = plain(model, body)
    if "messages" not in request:
        return request
    if body.get("tools"):
        request["tools"] = body["tools"]
    template_kwargs = vllm_template_kwargs(body)
    if template_kwargs:
        request["chat_template_kwargs"] = template_kwargs
    return request


def for_sglang(model: str, body: dict[str, Any]) -> dict[str, Any]:
    if "messages" not in body:
        return plain(model, body)
    return {**{k: v for k, v in body.items() if k not in NOT_RENDERED}, "model": model}


def vllm_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The template variables vLLM's chat route derives from the request's fields (see above)."""
    kwargs: dict[str, Any] = {}
    effort = body.get("reasoning_effort")
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        kwargs["enable_thinking"] = effort != "none"
    choice = body.get("tool_choice")
    if body.get("tools") and choice not in (None, "auto"):
        kwargs["tool_choice"] = _vllm_tool_choice(choice)
    response_format = body.get("response_format")
    if response_format is not None:
        kwargs["response_format"] = _vllm_response_format(response_format)
    return kwargs


def _vllm_tool_choice(choice: Any) -> Any:
    """``ChatCompletionNamedToolChoiceParam.model_dump(mode="json", exclude_none=True)``."""
    if not isinstance(choice, dict):
        return choice
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return {"function": {"name": name}, "type": choice.get("type", "function")}


def _vllm_response_format(response_format: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``ResponseFormat`` dumped as the Kimi K3 renderer dumps it: no null fields, and the
    JSON schema under its Python field name ``json_schema`` (``schema`` is only the alias)."""
    dumped = {k: v for k, v in response_format.items() if v is not None}
    inner = dumped.get("json_schema")
    if isinstance(inner, dict):
        fields = {k: v for k, v in inner.items() if v is not None and k != "schema"}
        ordered = {k: fields.pop(k) for k in ("name", "description") if k in fields}
        if inner.get("schema") is not None:
            ordered["json_schema"] = inner["schema"]
        dumped["json_schema"] = {**ordered, **fields}
    return dumped
