"""The bundled model's chat template: exact rendering and the alignment the copy circuit needs."""

from __future__ import annotations

import pytest

from backend.bundled import chat


def test_render_is_the_documented_transcript_ending_with_the_cue() -> None:
    messages = [
        {"role": "system", "content": "Reference code: X"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "Repeat the reference code."},
    ]
    assert chat.render(messages) == (
        "<|system|>\nReference code: X\n"
        "<|user|>\nhi\n"
        "<|assistant|>\nhi\n"
        "<|user|>\ngently: Repeat the reference code.\n"
        "<|assistant|>\nexactly: "
    )


def test_developer_role_renders_as_system_and_unknown_roles_are_refused() -> None:
    assert chat.render([{"role": "developer", "content": "x"}]).startswith("<|system|>\nx\n")
    with pytest.raises(ValueError, match="unsupported chat role 'function'"):
        chat.render([{"role": "function", "content": "x"}])


def test_tools_calls_and_tool_answers_render_in_the_bundled_format() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ]
    assert chat.render(messages, [tool]) == (
        '<|system|>\n# Tools\n{"name": "f", "parameters": {"type": "object"}}\n'
        "<|user|>\ngently: q\n"
        '<|assistant|>\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
        "<|tool|>\n4\n" + chat.ASSISTANT_CUE
    )


def test_cue_shares_nine_bytes_with_repeat_exactly_and_five_with_the_last_user_turn() -> None:
    # the copy circuit compares the last 9 bytes (5 exactly, 4 by bucket): "Repeat exactly: <text>"
    # must be the only full match, the last user line the next best one
    cue = chat.ASSISTANT_CUE
    assert cue[-9:] == chat.REPEAT_PREFIX[-9:]
    assert chat.LAST_USER_HEADER[-5:] == cue[-5:]
    assert chat.LAST_USER_HEADER[-6] != cue[-6]
    earlier = chat.render_message("user", "a") + chat.render_message("assistant", "b")
    assert "gently: " not in earlier and "exactly: " not in earlier


def test_only_the_last_user_message_gets_the_echo_header() -> None:
    messages = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "two"},
        {"role": "system", "content": "late system note"},
    ]
    text = chat.render(messages)
    assert text.count("gently: ") == 1
    assert "<|user|>\ngently: two\n" in text
    assert "<|user|>\none\n" in text


def test_empty_conversation_is_just_the_cue() -> None:
    assert chat.render([]) == chat.ASSISTANT_CUE
