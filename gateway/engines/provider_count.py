"""Prompt token counts for engines the gateway cannot ask (providers through litellm, declared
OpenAI-compatible servers): never fewer than the provider will count, and close to it where the
provider's tokenizer is known.

Two methods, chosen per model:

- ``tiktoken``: OpenAI models (``openai/``, ``azure/`` or a bare OpenAI model name that tiktoken
  maps to an encoding). The BPE files are the ones litellm ships for offline use
  (``litellm_core_utils/tokenizers``; nothing is downloaded). A chat counts every message's
  role, name and content with the model's encoding, plus ``CHAT_TOKENS_PER_MESSAGE`` for the
  message's frame (OpenAI's format spends 3; a ChatML rendering with a newline after the role
  spends 4), ``CHAT_TOKENS_PER_NAME`` for a name and ``CHAT_TOKENS_PER_REQUEST`` for the reply's
  primer. Overcount against OpenAI's own accounting: at most 1 token per message, 2 with a name.
- ``bytes``: any other model. Every token of a byte-level or byte-fallback tokenizer covers at
  least one UTF-8 byte of the text it sees, so bytes plus a frame allowance per message can only
  overcount (English about 4x: such engines should be given a window with that in mind). The
  text a tokenizer sees may be NFKC-normalised first, which can lengthen it (U+FDFA becomes 18
  characters), so each field counts the larger of its bytes and its NFKC form's bytes.

Both bounds are checked by a property test (``tests/gateway/test_provider_count.py``) over
several chat renderings and scripts, and the overcount is measured there on an English corpus.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import unicodedata
from typing import Any

CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_PER_NAME = 2  # a name rendered beside the role (OpenAI's own format spends 1)
CHAT_TOKENS_PER_REQUEST = 3
PROMPT_SPECIAL_TOKENS = 2  # BOS/EOS a completion endpoint may add around the prompt
BYTES_PER_MESSAGE = 16  # tokens of the longest chat frame checked (plain-text markers), with slack
BYTES_PER_REQUEST = 16
OPENAI_PREFIXES = ("openai/", "azure/", "text-completion-openai/")
FIELDS = ("role", "name", "content")
SHIPPED_ENCODINGS = frozenset({"cl100k_base", "o200k_base", "p50k_base"})


def count_method(model: str | None) -> str:
    return "tiktoken" if _encoding_name(model) is not None else "bytes"


def upper_bound_tokens(
    model: str | None, prompt: str | None, messages: list[dict[str, Any]] | None
) -> int:
    """Tokens the provider will count for this prompt, never fewer."""
    name = _encoding_name(model)
    if name is None:
        return _bytes_bound(prompt, messages)
    encode = _encoder(name)
    if messages is None:
        return len(encode(prompt or "")) + PROMPT_SPECIAL_TOKENS
    total = CHAT_TOKENS_PER_REQUEST
    for message in messages:
        total += CHAT_TOKENS_PER_MESSAGE
        total += CHAT_TOKENS_PER_NAME if message.get("name") else 0
        total += sum(len(encode(_text(message.get(key)))) for key in FIELDS if key in message)
    return total


def _bytes_bound(prompt: str | None, messages: list[dict[str, Any]] | None) -> int:
    if messages is None:
        return _bytes(prompt or "") + BYTES_PER_REQUEST
    total = BYTES_PER_REQUEST
    for message in messages:
        total += BYTES_PER_MESSAGE
        total += sum(_bytes(_text(value)) for value in message.values())
    return total


def _bytes(text: str) -> int:
    raw = len(text.encode("utf-8"))
    if text.isascii():
        return raw
    return max(raw, len(unicodedata.normalize("NFKC", text).encode("utf-8")))


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: text is counted, anything else as its JSON
        return "".join(
            part.get("text", "") if isinstance(part, dict) and "text" in part else str(part)
            for part in value
        )
    return "" if value is None else str(value)


def _encoding_name(model: str | None) -> str | None:
    if not model:
        return None
    bare = model
    for prefix in OPENAI_PREFIXES:
        if model.startswith(prefix):
            bare = model[len(prefix) :]
            break
    else:
        if "/" in model:
            return None  # another provider's model: its tokenizer is not known here
    tiktoken = _tiktoken()
    try:
        name: str = tiktoken.encoding_name_for_model(bare)
    except KeyError:
        return None
    return name if name in available_encodings() else None


def available_encodings() -> frozenset[str]:
    """The encodings whose BPE files litellm ships (any other would need a download)."""
    return SHIPPED_ENCODINGS


@functools.cache
def _encoder(name: str) -> Any:
    encoding = _tiktoken().get_encoding(name)
    return functools.partial(encoding.encode, disallowed_special=())


@functools.cache
def _tiktoken_dir() -> str:
    spec = importlib.util.find_spec("litellm")  # its location, without the slow import
    if spec is None or spec.origin is None:
        raise RuntimeError("litellm is not installed")
    return os.path.join(os.path.dirname(spec.origin), "litellm_core_utils", "tokenizers")


@functools.cache
def _tiktoken() -> Any:
    # litellm's bundled BPE files; TIKTOKEN_CACHE_DIR is how tiktoken is told where they are.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")
    os.environ["TIKTOKEN_CACHE_DIR"] = _tiktoken_dir()
    import tiktoken

    return tiktoken
