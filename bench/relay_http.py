"""The raw HTTP/1.1 connection the relay benchmark's processes share: bytes to an httptools parser.

``HttpConnection`` feeds what arrives to its parser (a request or a response parser) and closes
the connection on bytes the parser refuses (``refused`` may answer first); ``RequestReader`` also
collects a request's URL and body and hands them to ``request`` when the message is complete.
Used by the engine stand-in, the lean floor and the load generator.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools


class HttpConnection(asyncio.Protocol):
    def __init__(self, parser_class: Any) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = parser_class(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.refused()
            if self.transport is not None:
                self.transport.close()

    def refused(self) -> None:
        """Bytes the parser refused arrived; the connection closes after this."""


class RequestReader(HttpConnection):
    def __init__(self) -> None:
        super().__init__(httptools.HttpRequestParser)
        self.url = b""
        self.body: list[bytes] = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, self.url = self.url, b""
        body, self.body = b"".join(self.body), []
        self.request(url, body)

    def request(self, url: bytes, body: bytes) -> None:
        raise NotImplementedError
