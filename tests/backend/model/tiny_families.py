"""Tiny random-weight checkpoints of the families users point the engine at, built offline.

Each family is written the way its real checkpoints ship, shrunk: the transformers model class and
config fields of the family (saved with ``save_pretrained``), a ``tokenizer.json`` built with the
``tokenizers`` library in the family's scheme, ``tokenizer_config.json`` with the family's special
tokens and tokenizer class, the chat template in the place and form the family uses, and
``generation_config.json``. Nothing is downloaded.

Each `Family` says what it exercises in `summary` (the models table in the docs shows it).

The templates are written in each family's style (alternation checks with ``raise_exception``,
``bos_token``/``eos_token``, block tags whose newlines only ``trim_blocks`` removes, indented
tags only ``lstrip_blocks`` strips, a tools branch with ``tojson``), not copied from the Hub.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CORPUS = [
    "Hello world, hello tokens! The quick brown fox jumps over the lazy dog.",
    "Der Bär isst Käse für 5 € — naïve café, déjà vu.",
    "日本語のテキストと English text mixed together.",
    "Llamas 🦙 and camels 🐫 walk in the desert; 42 + 17 = 59.",
    "def add(a, b):\n    return a + b\n",
    "You are a helpful assistant. What is the capital of France? Paris is.",
]

# Prompts the engine is compared on: ASCII, multi-byte characters, emoji, digits, newlines.
PROMPTS = [
    "Hello world",
    "The quick brown fox",
    "Der Bär isst Käse",
    "日本語 text",
    "Llamas 🦙 walk",
    "42 + 17 =",
    "def add(a, b):\n",
    "café déjà",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "A pear."},
        {"role": "user", "content": "Another one, with 🦙?"},
    ],
]

# -- chat templates ------------------------------------------------------------------------------

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# Block tags end their lines: without trim_blocks every one of them leaves a blank line.
LLAMA3_TEMPLATE = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}
{% set system_message = messages[0]['content'] | trim %}
{% set messages = messages[1:] %}
{% else %}
{% set system_message = "" %}
{% endif %}
{% if not date_string is defined %}
{% set date_string = "26 Jul 2024" %}
{% endif %}
<|start_header_id|>system<|end_header_id|>

Cutting Knowledge Date: December 2023
Today Date: {{ date_string }}

{% if tools %}
Environment: ipython
Respond with a call as {"name": function name, "parameters": its arguments}.
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
{% endif %}
{{ system_message }}<|eot_id|>{% for message in messages %}
{% if message['role'] == 'assistant' and message['tool_calls'] %}
<|start_header_id|>assistant<|end_header_id|>

{% for call in message['tool_calls'] %}{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|eom_id|>{% elif message['role'] == 'tool' %}
<|start_header_id|>ipython<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>{% else %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
"""  # noqa: E501

# Indented block tags: without lstrip_blocks their indentation is output.
QWEN2_TEMPLATE = """{%- if tools %}
<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}

# Tools
<tools>
    {% for tool in tools %}
{{ tool | tojson }}
    {% endfor %}
</tools>
For each call, return <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% else %}
    {% if messages[0]['role'] == 'system' %}
<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
    {% else %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
{% endif %}
{% for message in messages %}
    {% if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
    {% elif message.role == 'assistant' %}
<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
        {% for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
        {% endfor %}
<|im_end|>
    {% elif message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""  # noqa: E501

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
MISTRAL_TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}[TOOL_CALLS] ["
    "{% for call in message['tool_calls'] %}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% elif message['role'] == 'tool' %}[TOOL_RESULTS]{{ message['content'] }}[/TOOL_RESULTS]"
    "{% else %}{{ raise_exception('Only user, assistant and tool roles are supported!') }}"
    "{% endif %}{% endfor %}"
)

SMOLLM_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a small helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and message['content'] %}"
    "{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# -- tokenizers -----------------------------------------------------------------------------------


def _byte_fallback_bpe(specials: list[str], size: int) -> Any:
    """Llama-2 style: Metaspace (prepend at the first word only), BPE with byte fallback; the 256
    ``<0xNN>`` byte pieces follow the specials in the vocabulary, as in the real one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=specials, limit_alphabet=70)
    tok.train_from_iterator(CORPUS * 4, trainer)
    raw = json.loads(tok.to_str())
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(raw["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    raw["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True)
    for added in raw["added_tokens"]:
        added["id"] = vocab[added["content"]]
    tok = Tokenizer.from_str(json.dumps(raw))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


def _bos_template(bos: str, bos_id: int) -> Any:
    from tokenizers import processors

    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


def llama2_tokenizer() -> Any:
    tok = _byte_fallback_bpe(["<unk>", "<s>", "</s>"], 140)
    tok.post_processor = _bos_template("<s>", 1)
    return tok


def gemma3_tokenizer() -> Any:
    """Gemma's pipeline (the one transformers' GemmaTokenizer builds): spaces normalized to ``▁``
    with no prefix space, a split on spaces, byte-fallback BPE, a decoder that keeps a leading
    space; ids <pad> 0, <eos> 1, <bos> 2, <unk> 3, then the turn markers and the byte pieces."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tok = _byte_fallback_bpe(specials, 150)
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.post_processor = _bos_template("<bos>", 2)
    return tok


def phi3_tokenizer() -> Any:
    """Llama 2's vocabulary with Phi-3's chat tokens added at its end (32000+ in the real one)."""
    from tokenizers import AddedToken

    tok = _byte_fallback_bpe(["<unk>", "<s>", "</s>"], 140)
    tok.post_processor = _bos_template("<s>", 1)
    names = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>"]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    return tok


def mistral_tokenizer() -> Any:
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]"]
    tok = _byte_fallback_bpe(
        [*specials, "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], 150
    )
    tok.post_processor = _bos_template("<s>", 1)
    return tok


def _byte_level_bpe(
    pre_tokenizer: Any, specials_first: list[str], size: int, normalizer: Any = None
) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=specials_first,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def _special(tok: Any, names: list[str]) -> None:
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])


LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]


def llama3_tokenizer() -> Any:
    """tiktoken style: a regex split (contractions, letters, 1-3 digits, punctuation runs,
    whitespace) before byte-level BPE; special tokens at the end of the vocabulary."""
    from tokenizers import Regex, pre_tokenizers, processors

    split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok = _byte_level_bpe(pre, [], 330)
    _special(tok, LLAMA3_SPECIALS)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [processors.ByteLevel(trim_offsets=False), _bos_template("<|begin_of_text|>", bos)]
    )
    return tok


def qwen2_tokenizer() -> Any:
    """Qwen2's pipeline (the one transformers' Qwen2Tokenizer builds): NFC, its regex split,
    byte-level BPE, no BOS; special tokens at the end."""
    from tokenizers import Regex, normalizers, pre_tokenizers, processors
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok = _byte_level_bpe(pre, [], 320, normalizer=normalizers.NFC())
    _special(tok, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    # as in Qwen2.5: the tool-call tags are tokens of their own, not special (decode keeps them)
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_TOOL_TAGS])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


QWEN_TOOL_TAGS = ["<tool_call>", "</tool_call>"]


def smollm_tokenizer() -> Any:
    """GPT-2 byte-level BPE with ChatML specials at ids 0-2; adds no BOS."""
    from tokenizers import pre_tokenizers, processors

    tok = _byte_level_bpe(
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        320,
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


# -- families --------------------------------------------------------------------------------------

_SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.25,
)


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    summary: str  # what the tiny checkpoint exercises, for the models table
    model_class: str
    tokenizer: Callable[[], Any]
    config: dict[str, Any]
    # tokenizer_config.json; "<id:TOKEN>" values in `config` and `generation` become token ids
    tokenizer_config: dict[str, Any]
    generation: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)  # extra files (e.g. chat_template.jinja)
    stop_tokens: tuple[str, ...] = ()  # what the engine must stop on
    extra_vocab: int = 0  # model rows beyond the tokenizer (Qwen pads its embedding)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            name="llama2",
            title="Llama 2-style",
            summary="LlamaForCausalLM, MHA, rope_type dynamic (NTK, x128 past 8 positions: every "
            "prompt grows the base); Metaspace + byte-fallback BPE adding `<s>`; template string "
            "in tokenizer_config.json with `raise_exception`",
            model_class="LlamaForCausalLM",
            tokenizer=llama2_tokenizer,
            config=dict(
                num_key_value_heads=4,
                rms_norm_eps=1e-5,
                max_position_embeddings=8,
                rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=128.0),
                bos_token_id=1,
                eos_token_id=2,
            ),
            tokenizer_config=dict(
                tokenizer_class="LlamaTokenizer",
                bos_token="<s>",
                eos_token="</s>",
                unk_token="<unk>",
                add_bos_token=True,
                add_eos_token=False,
                legacy=False,
                clean_up_tokenization_spaces=False,
                chat_template=LLAMA2_TEMPLATE,
            ),
            generation=dict(bos_token_id=1, eos_token_id=2),
            stop_tokens=("</s>",),
        ),
        Family(
            name="llama3",
            title="Llama 3-style",
            summary="LlamaForCausalLM, GQA 4:1, rope_type llama3; tiktoken-style byte-level BPE "
            "adding `<|begin_of_text|>`; chat_template.jinja; `<|eot_id|>` only in "
            "generation_config.json",
            model_class="LlamaForCausalLM",
            tokenizer=llama3_tokenizer,
            config=dict(
                num_key_value_heads=1,
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=500000.0,
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=64,
                ),
                bos_token_id="<id:<|begin_of_text|>>",
                eos_token_id="<id:<|end_of_text|>>",  # end-of-turn lives in generation_config only
            ),
            tokenizer_config=dict(
                tokenizer_class="PreTrainedTokenizerFast",
                bos_token="<|begin_of_text|>",
                eos_token="<|end_of_text|>",
                clean_up_tokenization_spaces=True,
            ),
            generation=dict(
                bos_token_id="<id:<|begin_of_text|>>",
                eos_token_id=["<id:<|end_of_text|>>", "<id:<|eom_id|>>", "<id:<|eot_id|>>"],
            ),
            files={"chat_template.jinja": LLAMA3_TEMPLATE},
            stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        ),
        Family(
            name="qwen2",
            title="Qwen2-style",
            summary="Qwen2ForCausalLM: q/k/v bias, tied embeddings, rope_theta 1e6, embedding "
            "padded past the tokenizer; NFC + byte-level BPE, no BOS; multi-line template",
            model_class="Qwen2ForCausalLM",
            tokenizer=qwen2_tokenizer,
            config=dict(
                tie_word_embeddings=True,
                rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
                use_sliding_window=False,
                sliding_window=32768,
                max_window_layers=2,
                bos_token_id="<id:<|endoftext|>>",
                eos_token_id="<id:<|im_end|>>",
            ),
            tokenizer_config=dict(
                tokenizer_class="Qwen2Tokenizer",
                bos_token=None,
                eos_token="<|im_end|>",
                pad_token="<|endoftext|>",
                unk_token=None,
                errors="replace",
                clean_up_tokenization_spaces=False,
                chat_template=QWEN2_TEMPLATE,
            ),
            generation=dict(
                bos_token_id="<id:<|endoftext|>>",
                eos_token_id=["<id:<|im_end|>>", "<id:<|endoftext|>>"],
            ),
            stop_tokens=("<|im_end|>", "<|endoftext|>"),
            extra_vocab=7,
        ),
        Family(
            name="mistral",
            title="Mistral-style",
            summary="MistralForCausalLM, sliding window 12 (prompts are longer), head_dim 24; "
            "byte-fallback BPE with `[INST]` specials; named template list",
            model_class="MistralForCausalLM",
            tokenizer=mistral_tokenizer,
            config=dict(head_dim=24, sliding_window=12, bos_token_id=1, eos_token_id=2),
            tokenizer_config=dict(
                tokenizer_class="LlamaTokenizer",
                bos_token="<s>",
                eos_token="</s>",
                unk_token="<unk>",
                add_bos_token=True,
                legacy=False,
                chat_template=[
                    {"name": "default", "template": MISTRAL_TEMPLATE},
                    {"name": "tool_use", "template": MISTRAL_TOOL_TEMPLATE},
                ],
            ),
            generation=dict(bos_token_id=1, eos_token_id=2),
            stop_tokens=("</s>",),
        ),
        Family(
            name="qwen3",
            title="Qwen3-style",
            summary="Qwen3ForCausalLM: q/k norms, head_dim 32 (not hidden/heads), rope_type yarn "
            "(factor 4 over 256 positions); Qwen2's tokenizer and ChatML template with tools",
            model_class="Qwen3ForCausalLM",
            tokenizer=qwen2_tokenizer,
            config=dict(
                head_dim=32,
                tie_word_embeddings=True,
                rope_parameters=dict(
                    rope_type="yarn",
                    rope_theta=1000000.0,
                    factor=4.0,
                    original_max_position_embeddings=256,
                ),
                bos_token_id="<id:<|endoftext|>>",
                eos_token_id="<id:<|im_end|>>",
            ),
            tokenizer_config=dict(
                tokenizer_class="Qwen2Tokenizer",
                bos_token=None,
                eos_token="<|im_end|>",
                pad_token="<|endoftext|>",
                unk_token=None,
                clean_up_tokenization_spaces=False,
                chat_template=QWEN2_TEMPLATE,
            ),
            generation=dict(eos_token_id=["<id:<|im_end|>>", "<id:<|endoftext|>>"]),
            stop_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        Family(
            name="gemma3",
            title="Gemma 3-style",
            summary="Gemma3ForCausalLM (text): norms scaling by 1 + w around attention and the "
            "MLP, q/k norms, embedding x sqrt(hidden), GELU-tanh, query_pre_attn_scalar 24, "
            "sliding (window 8, RoPE base 1e4) and global layers (linear RoPE x8, base 1e6) "
            "alternating; byte-fallback BPE with `<start_of_turn>`",
            model_class="Gemma3ForCausalLM",
            tokenizer=gemma3_tokenizer,
            config=dict(
                num_hidden_layers=4,
                head_dim=16,
                query_pre_attn_scalar=24,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"] * 2,
                rope_parameters=dict(
                    full_attention=dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
                    sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                ),
                bos_token_id=2,
                eos_token_id=[1, "<id:<end_of_turn>>"],
                pad_token_id=0,
            ),
            tokenizer_config=dict(
                tokenizer_class="GemmaTokenizer",
                bos_token="<bos>",
                eos_token="<eos>",
                pad_token="<pad>",
                unk_token="<unk>",
                add_bos_token=True,
                chat_template=GEMMA3_TEMPLATE,
            ),
            generation=dict(bos_token_id=2, eos_token_id=[1, "<id:<end_of_turn>>"]),
            stop_tokens=("<eos>", "<end_of_turn>"),
        ),
        Family(
            name="phi3",
            title="Phi-3-style",
            summary="Phi3ForCausalLM: fused qkv_proj and gate_up_proj tensors, longrope (short "
            "factors within 32 positions, long ones beyond), sliding window 24; Llama 2's "
            "tokenizer with `<|user|>`, `<|end|>` added",
            model_class="Phi3ForCausalLM",
            tokenizer=phi3_tokenizer,
            config=dict(
                sliding_window=24,
                original_max_position_embeddings=32,
                rope_parameters=dict(
                    rope_type="longrope",
                    rope_theta=10000.0,
                    short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                    long_factor=[1.0, 1.5, 2.2, 3.0, 4.1, 5.5, 7.2, 9.0],
                ),
                bos_token_id=1,
                eos_token_id="<id:<|endoftext|>>",
                pad_token_id="<id:<|endoftext|>>",
            ),
            tokenizer_config=dict(
                tokenizer_class="LlamaTokenizer",
                bos_token="<s>",
                eos_token="<|endoftext|>",
                unk_token="<unk>",
                pad_token="<|endoftext|>",
                add_bos_token=False,
                legacy=False,
                chat_template=PHI3_TEMPLATE,
            ),
            generation=dict(bos_token_id=1, eos_token_id=["<id:<|endoftext|>>", "<id:<|end|>>"]),
            stop_tokens=("<|endoftext|>", "<|end|>"),
        ),
        Family(
            name="smollm",
            title="SmolLM-style",
            summary="LlamaForCausalLM, tied embeddings; GPT-2 byte-level BPE adding no BOS while "
            "config.json names one; ChatML template",
            model_class="LlamaForCausalLM",
            tokenizer=smollm_tokenizer,
            config=dict(
                num_key_value_heads=4, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2
            ),
            tokenizer_config=dict(
                tokenizer_class="GPT2Tokenizer",
                bos_token="<|im_start|>",
                eos_token="<|im_end|>",
                unk_token="<|endoftext|>",
                pad_token="<|im_end|>",
                add_prefix_space=False,
                clean_up_tokenization_spaces=False,
                chat_template=SMOLLM_TEMPLATE,
            ),
            generation=dict(bos_token_id=1, eos_token_id=2),
            stop_tokens=("<|im_end|>",),
        ),
    ]
}


def _resolve(value: Any, tok: Any) -> Any:
    if isinstance(value, str) and value.startswith("<id:") and value.endswith(">"):
        token_id = tok.token_to_id(value[4:-1])
        assert token_id is not None, value
        return token_id
    if isinstance(value, list):
        return [_resolve(v, tok) for v in value]
    if isinstance(value, dict):
        return {k: _resolve(v, tok) for k, v in value.items()}
    return value


def write_family(family: Family, path: Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """The family's tiny checkpoint in ``path`` (a directory), as its real ones are laid out."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = family.tokenizer()
    tok.save(str(path / "tokenizer.json"))
    model_cls = getattr(transformers, family.model_class)
    settings = {**_SMALL, **_resolve(family.config, tok)}
    settings["vocab_size"] = tok.get_vocab_size() + family.extra_vocab
    torch.manual_seed(seed)
    config = model_cls.config_class(**settings)
    model = model_cls(config).eval()
    with torch.no_grad():  # transformers starts biases at zero, where a dropped bias goes unseen
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(
        json.dumps(_resolve(family.generation, tok), indent=2)
    )
    (path / "tokenizer_config.json").write_text(json.dumps(family.tokenizer_config, indent=2))
    for name, text in family.files.items():
        (path / name).write_text(text, encoding="utf-8")
    return path


def stop_ids(family: Family, tok: Any) -> set[int]:
    return {tok.token_to_id(t) for t in family.stop_tokens}


# -- references from transformers -----------------------------------------------------------------

REPLACEMENT = "\ufffd"
FAMILY_NAMES = list(FAMILIES)


def completion_text(hf_tok: Any, prompt_ids: list[int], ids: list[int]) -> str:
    """transformers' text for `ids` after `prompt_ids`: decode(all) minus decode(prompt).

    A byte-fallback run ending the prompt is left out of the prompt first: otherwise generated
    byte pieces join it and decode turns the prompt's own last character into U+FFFD, which is
    no text of the completion."""
    prompt_ids = list(prompt_ids)
    while prompt_ids and hf_tok.convert_ids_to_tokens(prompt_ids[-1]).startswith("<0x"):
        prompt_ids.pop()
    full = hf_tok.decode(prompt_ids + list(ids), skip_special_tokens=True)
    return full[len(hf_tok.decode(prompt_ids, skip_special_tokens=True)) :]


def assert_honest(text: str, hf_tok: Any, prompt_ids: list[int], ids: list[int]) -> None:
    """`text` is transformers' text of `ids`, except that a character cut by the end of
    generation may be missing: the reference then ends in U+FFFD, and `text` is the reference
    without it, or the reference of the ids before the cut character. The cut character is at
    most the last 3 tokens (a byte-level piece carries several bytes), or the whole trailing run
    of ``<0xNN>`` pieces: special tokens inside such a run carry no text and do not end it
    (``E1 <unk> <unk> 80`` is one character cut after two of its three bytes), the added ones
    that ``all_special_ids`` leaves out (Mistral's ``[INST]``) as much as the named ones."""
    want = completion_text(hf_tok, prompt_ids, ids)
    if text == want:
        return
    assert want.endswith(REPLACEMENT), (text, want)
    run = len(ids)
    special = set(hf_tok.all_special_ids)
    special |= {i for i, added in hf_tok.added_tokens_decoder.items() if added.special}
    while run and (ids[run - 1] in special or _is_byte_piece(hf_tok, ids[run - 1])):
        run -= 1
    first = max(0, min(len(ids) - 3, run))
    shorter = [completion_text(hf_tok, prompt_ids, ids[:k]) for k in range(first, len(ids))]
    assert text == want[:-1] or text in shorter, (text, want)


def _is_byte_piece(hf_tok: Any, token_id: int) -> bool:
    piece = hf_tok.convert_ids_to_tokens(token_id)
    return isinstance(piece, str) and piece.startswith("<0x")


def fresh_rope(hf_model: Any) -> None:
    """Forget what a dynamic RoPE of transformers remembers from earlier calls: it keeps the
    frequencies of the longest sequence it has seen until one shorter than the original window
    comes, so a reference computed after another would depend on that other. Each reference is a
    request alone (as the engine computes every sequence)."""
    for module in hf_model.modules():
        if getattr(module, "rope_type", None) == "dynamic":
            module.inv_freq.copy_(module.original_inv_freq)
            module.max_seq_len_cached = module.original_max_seq_len


def hf_greedy(hf_model: Any, prompt_ids: list[int], max_new: int, stops: set[int]) -> list[int]:
    """transformers' greedy continuation, ending on (and including) a stop token."""
    import torch

    fresh_rope(hf_model)
    out = hf_model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=sorted(stops),
        pad_token_id=sorted(stops)[0],
    )
    return [int(t) for t in out[0, len(prompt_ids) :]]
