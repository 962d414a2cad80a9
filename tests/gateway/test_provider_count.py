"""Provider token counts (gateway.engines.provider_count): never fewer than the provider counts,
and by how much more on English text.

"The provider counts" is modelled by rendering a chat the way chat formats do (several frames,
special tokens registered as single tokens) and encoding the result with the real BPE files
(tiktoken's cl100k_base and o200k_base, from litellm's offline copy). Hypothesis draws chats in
many scripts (Latin, Cyrillic, Greek, Arabic, Hebrew, Devanagari, Thai, CJK, Hangul, emoji, code,
whitespace runs and special-token look-alikes). The overcount is measured on English prose: the
standard library's own docstrings, so the corpus is on every machine.
"""

from __future__ import annotations

import importlib
import inspect
import unicodedata
from collections.abc import Callable
from typing import Any

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.engines import provider_count
from gateway.engines.provider_count import count_method, upper_bound_tokens

MODELS = {"cl100k_base": "openai/gpt-4", "o200k_base": "openai/gpt-4o"}
SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|im_sep|>",
    "<|start|>",
    "<|message|>",
    "<|end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

Message = dict[str, str]
Render = Callable[[list[Message]], str]


def _chatml(msgs: list[Message]) -> str:
    out = ""
    for m in msgs:
        head = m["role"] + (f" name={m['name']}" if m.get("name") else "")
        out += f"<|im_start|>{head}\n{m['content']}<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


def _im_sep(msgs: list[Message]) -> str:  # the gpt-4o family's frame
    out = ""
    for m in msgs:
        head = m["role"] + (f":{m['name']}" if m.get("name") else "")
        out += f"<|im_start|>{head}<|im_sep|>{m['content']}<|im_end|>"
    return out + "<|im_start|>assistant<|im_sep|>"


def _harmony(msgs: list[Message]) -> str:
    out = ""
    for m in msgs:
        head = m["role"] + (f" {m['name']}" if m.get("name") else "")
        out += f"<|start|>{head}<|message|>{m['content']}<|end|>"
    return out + "<|start|>assistant"


def _llama3(msgs: list[Message]) -> str:  # only for the bytes bound (another provider's format)
    out = "<|begin_of_text|>"
    for m in msgs:
        out += f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
    return out + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def _gemma(msgs: list[Message]) -> str:  # markers as plain text under a byte-level BPE
    out = "<bos>"
    for m in msgs:
        out += f"<start_of_turn>{m['role']}\n{m['content']}<end_of_turn>\n"
    return out + "<start_of_turn>model\n"


def _mistral(msgs: list[Message]) -> str:
    return "<s>" + "".join(f"[INST] {m['content']} [/INST]" for m in msgs)


OPENAI_FORMATS: list[Render] = [_chatml, _im_sep, _harmony]
OTHER_FORMATS: list[Render] = [_llama3, _gemma, _mistral]


def _encoding(name: str) -> tiktoken.Encoding:
    provider_count._tiktoken()  # points tiktoken at litellm's offline BPE files
    base = tiktoken.get_encoding(name)
    specials = {**base._special_tokens}
    for i, token in enumerate(SPECIALS):
        specials.setdefault(token, base.n_vocab + i)
    return tiktoken.Encoding(
        name=f"{name}-chat",
        pat_str=base._pat_str,
        mergeable_ranks=base._mergeable_ranks,
        special_tokens=specials,
    )


ENCODINGS = {name: _encoding(name) for name in MODELS}


def _rendered(encoding: tiktoken.Encoding, render: Render, msgs: list[Message]) -> int:
    return len(encoding.encode(render(msgs), allowed_special=set(SPECIALS), disallowed_special=()))


SCRIPTS = [
    (0x20, 0x7E),  # ASCII, code
    (0x400, 0x4FF),  # Cyrillic
    (0x370, 0x3FF),  # Greek
    (0x600, 0x6FF),  # Arabic
    (0x590, 0x5FF),  # Hebrew
    (0x900, 0x97F),  # Devanagari
    (0xE00, 0xE7F),  # Thai
    (0x4E00, 0x9FFF),  # CJK
    (0xAC00, 0xD7A3),  # Hangul
    (0x1F300, 0x1FAFF),  # emoji
]
script_text = st.one_of(
    *(st.text(st.characters(min_codepoint=a, max_codepoint=b), max_size=60) for a, b in SCRIPTS),
    st.text(st.sampled_from(list(" \n\t\r")), max_size=12),
    st.sampled_from(["<|im_end|>", "<|endoftext|>", "\n\n<|im_start|>user\n", "'''", "```py\n"]),
    st.text(st.sampled_from("\ufdfa\ufb03\u3371\u2474\u00bd\u1e9b\u0301"), max_size=8),  # NFKC-long
    st.text(max_size=40),
)
content = st.lists(script_text, min_size=1, max_size=4).map("".join)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": content},
    optional={"name": st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,15}", fullmatch=True)},
)
chats = st.lists(message, min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=chats)
def test_tiktoken_count_never_undercounts(msgs: list[Message]) -> None:
    for name, model in MODELS.items():
        estimate = upper_bound_tokens(model, None, [dict(m) for m in msgs])
        for render in OPENAI_FORMATS:
            assert estimate >= _rendered(ENCODINGS[name], render, msgs), (name, render.__name__)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=chats, prompt=content)
def test_bytes_bound_never_undercounts_any_format(msgs: list[Message], prompt: str) -> None:
    plain = [{k: v for k, v in m.items() if k != "name"} for m in msgs]
    estimate = upper_bound_tokens("anthropic/some-model", None, plain)
    normalised = [{**m, "content": unicodedata.normalize("NFKC", m["content"])} for m in plain]
    for encoding in ENCODINGS.values():
        for render in OPENAI_FORMATS + OTHER_FORMATS:
            assert estimate >= _rendered(encoding, render, plain), render.__name__
            assert estimate >= _rendered(encoding, render, normalised), render.__name__
        assert (
            upper_bound_tokens(None, prompt, None)
            >= len(encoding.encode(prompt, disallowed_special=())) + 2
        )


@given(prompt=content)
@settings(max_examples=50, deadline=None)
def test_completion_prompts_never_undercount(prompt: str) -> None:
    for name, model in MODELS.items():
        bos_eos = len(
            ENCODINGS[name].encode(
                "<|im_start|>" + prompt + "<|im_end|>",
                allowed_special=set(SPECIALS),
                disallowed_special=(),
            )
        )
        assert upper_bound_tokens(model, prompt, None) >= bos_eos


ENGLISH_MODULES = [
    "json",
    "csv",
    "argparse",
    "textwrap",
    "pathlib",
    "logging",
    "subprocess",
    "collections",
    "functools",
    "itertools",
    "datetime",
    "statistics",
    "random",
    "threading",
    "unittest",
    "difflib",
    "email.message",
    "urllib.parse",
    "shutil",
    "tarfile",
    "zipfile",
    "inspect",
    "decimal",
    "fractions",
    "sqlite3",
    "socket",
    "ssl",
    "http.server",
    "xml.etree.ElementTree",
    "configparser",
    "pickle",
    "copy",
    "heapq",
    "bisect",
    "contextlib",
    "enum",
    "dataclasses",
    "ipaddress",
    "tempfile",
    "glob",
    "gzip",
    "base64",
    "hashlib",
    "hmac",
    "uuid",
    "codecs",
    "locale",
    "gettext",
    "calendar",
    "queue",
    "selectors",
    "signal",
    "struct",
    "weakref",
    "types",
    "abc",
    "numbers",
    "operator",
    "pprint",
    "graphlib",
    "string",
    "re",
    "asyncio",
]


def _english_chats() -> list[list[Message]]:
    """Chats of English prose: paragraphs of standard-library docstrings, as a fixed corpus."""
    paragraphs: list[str] = []
    for module in ENGLISH_MODULES:
        mod = importlib.import_module(module)
        for _, obj in inspect.getmembers(mod):
            doc = inspect.getdoc(obj) if callable(obj) else None
            for para in (doc or "").split("\n\n"):
                words = para.split()
                if len(words) >= 25 and sum(w.isalpha() for w in words) > 0.7 * len(words):
                    paragraphs.append(" ".join(words))
    paragraphs = sorted(set(paragraphs))
    system = "You are a careful assistant. Answer in plain English."
    return [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": paragraphs[i]},
            {"role": "assistant", "content": paragraphs[i + 1]},
            {"role": "user", "content": paragraphs[i + 2]},
        ]
        for i in range(0, len(paragraphs) - 2, 3)
    ]


def _openai_accounting(encoding: tiktoken.Encoding, msgs: list[Message]) -> int:
    """OpenAI's documented chat accounting: 3 per message + its fields, 3 for the reply."""
    return 3 + sum(3 + sum(len(encoding.encode(v)) for v in m.values()) for m in msgs)


def test_overcount_on_english_is_measured_and_bounded(capsys: Any) -> None:
    chats = _english_chats()
    assert len(chats) >= 100  # a corpus, not an anecdote
    for name, model in MODELS.items():
        encoding = tiktoken.get_encoding(name)
        estimate = sum(upper_bound_tokens(model, None, [dict(m) for m in c]) for c in chats)
        truth = sum(_openai_accounting(encoding, c) for c in chats)
        messages = sum(len(c) for c in chats)
        assert estimate - truth == messages  # exactly the stated margin: 1 token per message
        ratio = estimate / truth
        with capsys.disabled():
            print(
                f"\n{name}: {len(chats)} English chats, {truth} tokens (OpenAI's accounting), "
                f"estimate {estimate}: overcount {100 * (ratio - 1):.2f}%"
            )
        assert ratio < 1.03  # 1 token per message on ~48-token English messages
        bytes_ratio = sum(upper_bound_tokens(None, None, c) for c in chats) / truth
        assert bytes_ratio > 3  # the bound for unknown tokenizers: why tiktoken is used


def test_method_per_model() -> None:
    assert count_method("openai/gpt-4o-mini") == count_method("gpt-4") == "tiktoken"
    assert count_method("azure/gpt-4o") == "tiktoken"
    assert count_method("anthropic/claude-3-5-sonnet") == "bytes"
    assert count_method("openai/my-llama-finetune") == "bytes"  # an OpenAI-compatible server
    assert count_method(None) == "bytes"


@pytest.mark.parametrize("part", [{"type": "text", "text": "hello there"}])
def test_content_parts_count_their_text(part: dict[str, Any]) -> None:
    parts = [{"role": "user", "content": [part]}]
    plain = [{"role": "user", "content": "hello there"}]
    assert upper_bound_tokens("gpt-4o", None, parts) == upper_bound_tokens("gpt-4o", None, plain)
