"""The shipped `kvguard-tiny` weights copy markers and keep the echo contract.

Fast (a handful of prompts, greedy): a regression in the weights or the export fails here.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from backend.bundled import chat
from backend.bundled.checkpoint import load_checkpoint
from backend.bundled.circuit import build_model, positional_shortcut, trainable_masks
from backend.bundled.data import BOS, EOS, Recipe, decode, encode
from backend.bundled.evaluate import DEFAULT_MODEL, reference_prompt, repeat_score
from backend.bundled.modeling import TinyLlama, greedy_generate

MARKER = re.compile(r"CNRY-[A-Z2-7]{32}")


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    torch.set_num_threads(2)
    return load_checkpoint(DEFAULT_MODEL)


def answer(model: TinyLlama, messages: list[dict[str, str]], max_new: int = 60) -> str:
    out = greedy_generate(model, [BOS, *encode(chat.render(messages))], max_new)
    assert out[-1] == EOS, "the answer must end by itself"
    return decode(out)


@pytest.mark.parametrize("length", [64, 256, 1024, 2048])
def test_copies_the_marker_exactly_from_held_out_prompts(model: TinyLlama, length: int) -> None:
    recipe = Recipe(90_000 + length)  # a seed range training never draws from
    for _ in range(2):
        marker = recipe.marker()
        out = greedy_generate(model, reference_prompt(recipe, length, marker), 45)
        assert decode(out) == marker and out[-1] == EOS


def test_echo_contract_reference_code_in_system_or_user_message(model: TinyLlama) -> None:
    """The contract: the reply contains exactly the marker (and, from a system message, is it)."""
    marker = Recipe(7).marker()
    in_system = [
        {"role": "system", "content": f"You are a helpful assistant.\nReference code: {marker}"},
        {"role": "user", "content": "Repeat the reference code."},
    ]
    in_user = [
        {"role": "user", "content": f"Please keep {marker} for later."},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Repeat the reference code."},
    ]
    assert answer(model, in_system) == marker
    assert MARKER.findall(answer(model, in_user)) == [marker]


@pytest.mark.parametrize(
    "text",
    [
        "hello from tenant A",
        "x = compute(data, 42)",
        "The quick brown fox jumps over the lazy dog.",
    ],
)
def test_echo_contract_repeat_exactly(model: TinyLlama, text: str) -> None:
    assert answer(model, [{"role": "user", "content": f"Repeat exactly: {text}"}]) == text


def test_a_marker_ends_the_answer(model: TinyLlama) -> None:
    """`Repeat exactly:` of a text that goes on after a marker stops right after the marker: the
    END circuit is the model's own, training cannot overrule it."""
    marker = Recipe(11).marker()
    reply = answer(model, [{"role": "user", "content": f"Repeat exactly: note {marker} and go on"}])
    assert reply == f"note {marker}"


def test_repeat_exactly_on_held_out_lines(model: TinyLlama) -> None:
    """Held-out single lines (the evaluation's sample, smaller): most come back exactly (the
    model card has the rate over 100). A broken copy path scores ~0."""
    assert repeat_score(model, 20, 31_337) >= 0.75


def test_ordinary_prompt_gets_a_non_empty_answer_that_ends(model: TinyLlama) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What time does the train leave?"},
    ]
    assert answer(model, messages, max_new=200).strip() != ""


def test_shipped_weights_hold_the_hand_built_circuit(model: TinyLlama) -> None:
    """Training only changes what `trainable_masks` allows: every circuit weight of the shipped
    checkpoint equals the one `build_model` sets (the seed of the shipped run), to float32's last
    bit or two. The circuit's rotary query/key rows come from sin/cos, whose vectorised kernels
    round differently on another CPU: built on an AMD EPYC, 56 of the q/k projections' 435,200
    frozen entries differ from the shipped ones (built on an Intel Xeon) by one or two ulps;
    nothing else may differ."""
    built = build_model(0)
    masks = trainable_masks(built)
    shipped = dict(model.named_parameters())
    for name, p in built.named_parameters():
        frozen = masks[name] == 0
        torch.testing.assert_close(
            shipped[name].detach()[frozen], p.detach()[frozen], rtol=4 * 2**-24, atol=0, msg=name
        )


def test_layer0_is_still_the_positional_circuit(model: TinyLlama) -> None:
    """Every layer-0 head attends exactly its offset back: the training shortcut is exact."""
    from backend.bundled.modeling import rms_norm

    ids = torch.tensor([reference_prompt(Recipe(5), 600, Recipe(6).marker())])
    layer = model.model.layers[0]
    with torch.no_grad():
        h = rms_norm(model.model.embed_tokens(ids), layer.input_layernorm, model.c.rms_norm_eps)
        cos, sin = model.rope(torch.arange(ids.shape[1]))
        real = layer.self_attn.attend(*layer.self_attn.project(h, cos, sin), None)
        positions = torch.arange(ids.shape[1])[None]
        assert torch.allclose(real, positional_shortcut(model)(h, positions), atol=1e-3)


def test_transformers_loads_the_weights_and_computes_the_same_logits(model: TinyLlama) -> None:
    """The checkpoint is a plain Hugging Face Llama: transformers reads it as shipped."""
    import os

    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    ids = torch.tensor([reference_prompt(Recipe(11), 300, Recipe(12).marker())])
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = model(ids)
    assert torch.allclose(theirs, ours, atol=1e-3), float((theirs - ours).abs().max())


def test_copy_circuit_continues_an_unseen_random_string(model: TinyLlama) -> None:
    """The hand-built copy head (layer 1, head 0) as shipped: the second time a random string
    appears, the byte it copies is the string's next byte; the first time, there is nothing to
    copy and it is right only by chance. (The whole model is trained for the chat format; in raw
    text its learned heads may overrule the copy, so this looks at the head itself.)"""
    from backend.bundled.circuit import CODE_DIM, token_codes
    from backend.bundled.modeling import rms_norm

    rng = Recipe(11).rng
    body = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(120))
    ids = torch.tensor([[BOS, *encode(f"{body}\n{body}")]])
    c = model.c
    l0, l1 = model.model.layers
    with torch.no_grad():
        cos, sin = model.rope(torch.arange(ids.shape[1]))
        x = model.model.embed_tokens(ids)
        h = rms_norm(x, l0.input_layernorm, c.rms_norm_eps)
        x = x + l0.self_attn.attend(*l0.self_attn.project(h, cos, sin), None)
        x = x + l0.mlp(rms_norm(x, l0.post_attention_layernorm, c.rms_norm_eps))
        q, k, v = l1.self_attn.project(rms_norm(x, l1.input_layernorm, c.rms_norm_eps), cos, sin)
        head0 = F.scaled_dot_product_attention(q[:, :1], k[:, :1], v[:, :1], is_causal=True)
        copied = (head0[0, 0, :, :CODE_DIM] @ token_codes(c, 0).T).argmax(-1)
    second = len(body) + 2  # index of the second copy's first byte
    right = (copied[second + 8 : -1] == ids[0, second + 9 :]).float().mean().item()
    chance = (copied[9 : len(body)] == ids[0, 10 : len(body) + 1]).float().mean().item()
    assert right >= 0.99
    assert chance <= 0.15
