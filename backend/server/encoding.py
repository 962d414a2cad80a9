"""The engine server's one JSON encoder for its answers: orjson (compact, UTF-8 as is), for every
streamed event (``formatting.sse``) and every whole answer (``JsonAnswer``), so a stream and a
whole answer spell the same text the same way. Python's encoder takes over only for what orjson
cannot write (an integer past 64 bits)."""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.responses import Response


def dumps(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


class JsonAnswer(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)
