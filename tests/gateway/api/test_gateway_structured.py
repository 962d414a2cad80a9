"""Structured output and tool calls through `kvguard up`'s stack (the gateway in front of the
bundled engine, which reports `tools` and `structured_output`), with the real client libraries,
unchanged: the `openai` SDK's `chat.completions.parse(response_format=<pydantic model>)`,
LangChain's `ChatOpenAI.with_structured_output` and `bind_tools`, and a two-step tool
conversation (the call, the tool's answer sent back, the model's next turn).

The schemas bound every value (enums, small integers, short arrays) and `max_tokens` fits the
longest answer, so the bundled model always finishes its JSON: each answer must parse into the
client's own type.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from kvguard.localservices import free_port
from kvguard.testing import interruptible

pytestmark = pytest.mark.slow
MODEL = "kvguard-tiny"


class Owner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["a", "b"]
    ok: bool


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["cat", "dog"]
    count: int = Field(ge=0, le=9)
    tags: list[bool] = Field(max_length=2)
    owner: Owner


LONGEST_PET = len(
    '{"kind": "cat", "count": 9, "tags": [false, false], "owner": {"role": "a", "ok": false}}'
)


class GetWeather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)


LONGEST_CALL = len('[{"name": "GetWeather", "arguments": {"city": "Paris", "days": 7}}]')
LONGEST_WEATHER_CALL = len('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 7}}]')
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": GetWeather.model_json_schema(),
    },
}


@pytest.fixture(scope="module")
def stack(
    tiny_checkpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """`kvguard up` (embedded profile): (gateway URL, the demo tenant's key)."""
    port, backend_port = free_port(), free_port()
    env = {
        **os.environ,
        "KVGUARD_MODEL": tiny_checkpoint,
        "KVGUARD_SERVED_MODEL_NAME": MODEL,
        "KVGUARD_TORCH_THREADS": "1",
    }
    data = tmp_path_factory.mktemp("up") / "data"
    argv = [sys.executable, "-m", "kvguard", "up", "--port", str(port)]
    argv += ["--backend-port", str(backend_port), "--data-dir", str(data)]
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=interruptible,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 240
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Press Ctrl-C" in line or time.monotonic() > deadline:
                break
        output = "".join(lines)
        key = re.search(r"API key \(shown once\): (\S+)", output)
        assert "all roles healthy" in output and key is not None, output
        yield f"http://127.0.0.1:{port}", key.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def _client(stack: tuple[str, str]) -> openai.OpenAI:
    url, key = stack
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key)


def test_the_sdk_parses_into_the_clients_model(stack: tuple[str, str]) -> None:
    completion = _client(stack).chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a pet."}],
        response_format=Pet,
        max_tokens=LONGEST_PET + 1,
        n=8,
    )
    assert len(completion.choices) == 8
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet), choice.message.content


def test_langchain_structured_output_and_bound_tools(stack: tuple[str, str]) -> None:
    from langchain_openai import ChatOpenAI

    url, key = stack
    llm = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key=key, max_tokens=LONGEST_PET + 1)
    pet = llm.with_structured_output(Pet, method="json_schema", strict=True).invoke(
        "Describe a pet."
    )
    assert isinstance(pet, Pet)
    caller = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key=key, max_tokens=LONGEST_CALL + 1)
    message = caller.bind_tools([GetWeather], tool_choice="any", parallel_tool_calls=False).invoke(
        "What is the weather in Rome?"
    )
    assert len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call["name"] == "GetWeather" and call["id"].startswith("call_")
    GetWeather.model_validate(call["args"])


def test_a_two_step_tool_conversation(stack: tuple[str, str]) -> None:
    client = _client(stack)
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=LONGEST_WEATHER_CALL + 1,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    GetWeather.model_validate(json.loads(call.function.arguments))
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"})
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=16, temperature=0
    )
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    # the call and the tool's answer were rendered into the second prompt
    assert second.usage is not None and first.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + len("Sunny, 21 C")
