"""Decode's ``PrefillMonitor`` outlives a prefill that dies mid-exchange.

A prefill that stops (a restart, a crash) between decode's capacity read and its announcement
drops the announcement's connection. Decode must fail closed (``prefill_unavailable``) while that
lasts and serve again once prefill answers: the monitor's polling task may not end on the broken
connection, or decode would report a stale path for as long as it runs (the gateway then never
routes to it again; seen as a fault-test run that stayed on ``no_healthy_engine``).

The prefill here is a double that speaks HTTP/1.1 on a real socket: it answers
``GET /engine/capacity`` as a prefill role does (``contracts.engine.CapacityReport``) and echoes
an announcement as ``POST /kv/v1/decode`` does, but closes the connection on the first
``drops`` announcements without a reply, as a prefill process killed at that moment does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from backend.core.admission import CapacityLimits
from backend.disagg.protocol import PROTOCOL_VERSION, DecodeAnnouncement
from backend.metrics import EngineMetrics
from backend.server.prefill_client import HttpPrefillChannel, PrefillMonitor
from contracts.engine import CapacityReport, Role, RoleCapacity
from tests.backend.disagg.disagg_messages import TARGET

PAGE = 16
ROLE = RoleCapacity(
    role=Role.PREFILL,
    page_size=PAGE,
    pool_pages=64,
    pool_tokens=64 * PAGE,
    free_pages=64,
    context_window=512,
    max_request_tokens=512,
    protocol_version=PROTOCOL_VERSION,
)
REPORT = CapacityReport(
    **ROLE.model_dump(exclude={"age_s"}), model="m", zero_on_free=True, roles=[ROLE]
)


class DyingPrefill:
    """``drops`` announcements end in a closed connection; then every one is echoed."""

    def __init__(self, drops: int) -> None:
        self.drops = drops
        self.announcements = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                lines = head.decode("latin-1").split("\r\n")
                length = next(
                    (
                        int(v)
                        for k, _, v in (x.partition(": ") for x in lines)
                        if k.lower() == "content-length"
                    ),
                    0,
                )
                body = await reader.readexactly(length)
                if lines[0].startswith("POST /kv/v1/decode"):
                    self.announcements += 1
                    if self.announcements <= self.drops:
                        return  # killed mid-exchange: the connection closes, no reply
                    reply = body
                else:
                    reply = REPORT.model_dump_json().encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%b" % (len(reply), reply)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def _monitor(link: Any) -> PrefillMonitor:
    return PrefillMonitor(
        link,
        announcement=DecodeAnnouncement(PROTOCOL_VERSION, TARGET),
        own_limits=CapacityLimits(PAGE, 64, 512),
        local_version=PROTOCOL_VERSION,
        refresh_s=0.05,
        stale_s=5.0,
        cross_role_admission=True,
        metrics=EngineMetrics("decode"),
    )


class Watched:
    """The real channel, telling when an announcement went through (``announced``); with
    ``fail_first``, its first capacity read fails in a way nobody foresaw (a bug)."""

    def __init__(self, channel: HttpPrefillChannel, *, fail_first: bool = False) -> None:
        self.channel, self.failed = channel, not fail_first
        self.announced = asyncio.Event()

    async def capacity(self, timeout_s: float) -> CapacityReport:
        if not self.failed:
            self.failed = True
            raise RuntimeError("unforeseen")
        return await self.channel.capacity(timeout_s)

    async def announce(self, message: DecodeAnnouncement, timeout_s: float) -> None:
        await self.channel.announce(message, timeout_s)
        # the monitor marks the path announced before it next awaits, so before a waiter runs
        self.announced.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.channel, name)


async def _until_announced(link: Watched, polling: asyncio.Task[None]) -> None:
    """Until an announcement went through (10 s at most); a polling task that ended fails at
    once (on the old code: with the broken connection's exception)."""
    announced = asyncio.create_task(link.announced.wait())
    await asyncio.wait([announced, polling], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    announced.cancel()
    assert not polling.done(), polling.exception()
    assert link.announced.is_set(), "no announcement went through within 10 s"


async def test_an_announcement_cut_off_by_a_dying_prefill_is_retried_until_it_lands() -> None:
    prefill = DyingPrefill(drops=2)
    url = await prefill.start()
    async with httpx.AsyncClient() as client:
        link = Watched(HttpPrefillChannel(url, client, local_version=PROTOCOL_VERSION))
        monitor = _monitor(link)
        assert not await monitor.refresh()  # the first announcement's connection dropped
        assert "transfer target" in (monitor.unavailable() or "")  # fails closed meanwhile
        polling = asyncio.create_task(monitor.run())
        try:
            await _until_announced(link, polling)
            assert monitor.unavailable() is None and prefill.announcements == 3
            monitor.admit(100, 16)  # decode serves again
        finally:
            polling.cancel()
            await prefill.stop()


async def test_a_refresh_that_fails_unforeseen_fails_closed_and_polling_goes_on() -> None:
    prefill = DyingPrefill(drops=0)
    url = await prefill.start()
    async with httpx.AsyncClient() as client:
        channel = HttpPrefillChannel(url, client, local_version=PROTOCOL_VERSION)
        link = Watched(channel, fail_first=True)
        monitor = _monitor(link)
        polling = asyncio.create_task(monitor.run())
        try:
            await _until_announced(link, polling)
            assert link.failed
            assert monitor.unavailable() is None
        finally:
            polling.cancel()
            await prefill.stop()
