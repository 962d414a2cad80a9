"""Each family's tiny checkpoint served by a real `kvguard backend unified` process, over HTTP.

One engine per family (module-scoped, started with `--served-model-name`), checked against
transformers on the same directory:
- tokenizer: `/tokenize` of a prompt is `AutoTokenizer(prompt)` (BOS only if the tokenizer adds
  it), and `usage.prompt_tokens` agrees;
- template: `/tokenize` of a conversation is `apply_chat_template(..., add_generation_prompt=True)`;
  a conversation the template rejects (Mistral's has no system role) is a 400 with its message;
- greedy: one completion alone equals transformers' greedy continuation (text, token count,
  finish reason, stopping on the family's end-of-turn ids);
- batched: eight concurrent completions, each equal to its own greedy continuation;
- structured output: 100 of 100 ``json_schema`` answers (nesting, enums, arrays, required
  fields) validate against the schema, streamed and not, each ending "stop" within a budget its
  longest answer fits (``structured_cases``);
- tool calls: ``/tokenize`` of a conversation with tools, an assistant's calls and the tool's
  answer is ``apply_chat_template(..., tools=...)`` (arguments given as objects, as vLLM renders
  them); 100 of 100 ``tool_choice: "required"`` answers are one parsable call of an offered tool
  whose arguments validate, streamed and not;
- streaming text: a streamed chat answer equals transformers' decode of the same tokens (no
  U+FFFD for a character still arriving, the first token's leading space kept), and equals the
  non-streamed answer; a byte-fallback stream (Llama 2, Mistral) that logit_bias makes end on
  invalid bytes or inside a character ends with [DONE], its text transformers' decode of the same
  ids less the cut character.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import structured_cases as cases
from tiny_families import (
    CONVERSATIONS,
    CORPUS,
    FAMILIES,
    FAMILY_NAMES,
    PROMPTS,
    REPLACEMENT,
    assert_honest,
    completion_text,
    fresh_rope,
    hf_greedy,
)

from kvguard.testing import launch_engine

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def family(request, family_checkpoint, hf_family) -> Iterator[dict[str, Any]]:
    """The family's engine process and transformers' tokenizer and model (one per family: the
    tests of a family run together)."""
    name = request.param
    tok, hf = hf_family(name)
    engine = launch_engine(
        str(family_checkpoint(name)),
        env={"KVGUARD_MAX_RUNNING": "128"},
        pool_tokens=4096,
        page_size=16,
        served_model_name=f"tiny/{name}",
    )
    stops = {tok.convert_tokens_to_ids(t) for t in FAMILIES[name].stop_tokens}
    yield {"name": name, "engine": engine, "tok": tok, "hf": hf, "stops": stops}
    engine.stop()


def families(test):
    return pytest.mark.parametrize("family", FAMILY_NAMES, indirect=True)(test)


def _post(f: dict[str, Any], path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f["engine"].url + path, json={"model": f"tiny/{f['name']}", **body}, timeout=60
    )


def _check_completion(f, prompt_ids, body):
    """A completion's text, usage and finish reason against transformers' greedy tokens."""
    want = hf_greedy(f["hf"], prompt_ids, MAX_TOKENS, f["stops"])
    text_ids = [t for t in want if t not in f["stops"]]
    choice = body["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    assert_honest(text, f["tok"], prompt_ids, text_ids)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == len(want)
    assert choice["finish_reason"] == ("stop" if want[-1] in f["stops"] else "length")
    return completion_text(f["tok"], prompt_ids, text_ids)


@families
def test_tokenize(family):
    f = family
    for prompt in PROMPTS:
        answer = _post(f, "/tokenize", {"prompt": prompt}).json()
        assert answer["tokens"] == f["tok"](prompt)["input_ids"], prompt


@families
def test_chat_template(family):
    import jinja2

    f = family
    for messages in CONVERSATIONS:
        answer = _post(f, "/tokenize", {"messages": messages})
        try:
            want = f["tok"].apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        except jinja2.TemplateError as exc:  # the family's template rejects this conversation
            assert answer.status_code == 400
            assert str(exc) in answer.json()["error"]["message"]
            continue
        assert answer.status_code == 200, answer.text
        assert answer.json()["tokens"] == want


@families
def test_greedy(family):
    f = family
    prompt = PROMPTS[0]
    response = _post(
        f, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    _check_completion(f, f["tok"](prompt)["input_ids"], response.json())


@families
def test_batched(family):
    """Eight requests in flight together: continuous batching changes no request's tokens."""
    f = family

    async def send_all():
        async with httpx.AsyncClient(base_url=f["engine"].url, timeout=60) as client:
            bodies = [
                {
                    "model": f"tiny/{f['name']}",
                    "prompt": p,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                }
                for p in PROMPTS
            ]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(send_all())
    for prompt, response in zip(PROMPTS, responses, strict=True):
        assert response.status_code == 200, response.text
        _check_completion(f, f["tok"](prompt)["input_ids"], response.json())


@pytest.mark.parametrize("family", ["llama2", "mistral"], indirect=True)
def test_first_token_keeps_its_leading_space(family):
    """Metaspace tokenizers strip the space of a text's first "▁" piece; the first generated
    token is not the start of the text, so its space must be sent."""
    import torch

    f = family
    words = " ".join(CORPUS).split()
    rng = random.Random(0)
    for _ in range(1000):  # a prompt whose greedy answer starts with a "▁" piece (about 1 in 60)
        prompt = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 6)))
        ids = f["tok"](prompt)["input_ids"]
        fresh_rope(f["hf"])  # llama2's dynamic RoPE would read with the longest prompt's scale
        with torch.no_grad():
            first = int(f["hf"](torch.tensor([ids])).logits[0, -1].argmax())
        if f["tok"].convert_ids_to_tokens(first).startswith("▁"):
            break
    else:
        pytest.fail("no prompt found whose answer starts with a ▁ piece")
    response = _post(f, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    text = response.json()["choices"][0]["text"]
    assert text.startswith(" ") and text == completion_text(f["tok"], ids, [first]), (prompt, text)


def _sse(f, path, body):
    """A stream's events, ``[DONE]`` included, after a 200."""
    body = {"model": f"tiny/{f['name']}", **body, "stream": True}
    with httpx.stream("POST", f["engine"].url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def _stream_chat(f, messages):
    body = {
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    events = _sse(f, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    usage = next((e["usage"] for e in events[:-1] if e.get("usage")), None)
    deltas = [c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"]]
    return deltas, usage


@families
def test_streaming_text(family):
    f = family
    for messages in CONVERSATIONS:
        try:
            ids = f["tok"].apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        except Exception:
            continue  # a conversation the template rejects: test_chat_template
        deltas, usage = _stream_chat(f, messages)
        full = _post(
            f,
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0},
        )
        want = _check_completion(f, ids, full.json())
        text = "".join(deltas)
        assert text == full.json()["choices"][0]["message"]["content"]
        assert usage == full.json()["usage"]
        # U+FFFD only where transformers' text has it too (a truly invalid byte, never a
        # character still arriving)
        assert text.count(REPLACEMENT) <= want.count(REPLACEMENT)


@pytest.mark.parametrize("family", ["llama2", "mistral"], indirect=True)
@pytest.mark.parametrize(
    ("prompt", "piece", "max_tokens"),
    [
        # the prompt ends in the byte piece <0x27> ("'"), then stray continuation bytes: the
        # decoder regroups the run into U+FFFD, which made the library's stream decoder raise
        ("Hello '", "<0xA3>", 3),
        # the first byte of a three-byte character, cut by max_tokens: no text, not U+FFFD
        ("Hello", "<0xE2>", 1),
        # an invalid byte (a lead byte followed by a lead byte), then a lead byte cut
        ("Hello", "<0xE2>", 2),
    ],
    ids=["invalid-after-prompt-byte", "cut-in-a-character", "invalid-then-cut"],
)
def test_byte_fallback_stream_ends_honestly(family, prompt, piece, max_tokens):
    """A stream of byte pieces (forced by logit_bias) that ends inside a character or on invalid
    bytes: a 200 that ends with the finish chunk and [DONE], its text transformers' decode of
    the same ids, U+FFFD only for a byte transformers decodes so too, none for a character cut by
    max_tokens (left out)."""
    f = family
    tok = f["tok"]
    forced = tok.convert_tokens_to_ids(piece)
    prompt_ids = tok(prompt)["input_ids"]
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": {str(forced): 100},
        "stream_options": {"include_usage": True},
    }

    events = _sse(f, "/v1/completions", body)

    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert events[-2]["usage"]["completion_tokens"] == max_tokens
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    deltas = [c["text"] for e in events[:-2] for c in e["choices"]]
    text = "".join(deltas)
    ids = [forced] * max_tokens
    assert_honest(text, tok, prompt_ids, ids)
    hf_text = tok.decode(ids, skip_special_tokens=True)
    cut = hf_text.endswith(REPLACEMENT) and piece == "<0xE2>"  # the last lead byte's character
    assert text == (hf_text[:-1] if cut else hf_text)
    assert text.count(REPLACEMENT) == hf_text.count(REPLACEMENT) - cut


@families
def test_json_schema(family):
    f = family
    for answers in cases.both_ways(f["engine"].url, f"tiny/{f['name']}", cases.schema_body(), 100):
        cases.check_schema_answers(answers, 100)


TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]


def _hf_messages(messages):
    """The conversation as the engine hands it to a template (as vLLM does): a call's arguments
    as an object, an absent content as ""."""
    out = []
    for m in messages:
        m = {**m, "content": m["content"] or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


@families
def test_tools_template(family):
    import jinja2

    f = family
    for messages in (cases.MESSAGES, TOOL_CONVERSATION):
        answer = _post(f, "/tokenize", {"messages": messages, "tools": cases.TOOLS})
        try:
            want = f["tok"].apply_chat_template(
                _hf_messages(messages), tools=cases.TOOLS, add_generation_prompt=True
            )["input_ids"]
        except jinja2.TemplateError as exc:  # a template without tool turns refuses them
            assert answer.status_code == 400
            assert str(exc) in answer.json()["error"]["message"]
            continue
        assert answer.status_code == 200, answer.text
        assert answer.json()["tokens"] == want


@families
def test_required_tool_call(family):
    f = family
    url, model = f["engine"].url, f"tiny/{f['name']}"
    for answers in cases.both_ways(url, model, cases.required_body(), 50):
        cases.check_required_answers(answers, 50)
