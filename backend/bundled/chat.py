"""Placeholder chat format (replaced by the bundled model's trained format)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def render(messages: Sequence[Mapping[str, str]]) -> str:
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant: "])
