"""The relay benchmark's load generator: open-loop HTTP/1.1 on raw asyncio protocols (uvloop).

It shares one core with the engine stand-in, Redis and PostgreSQL, so it is built to cost little
per request: request bytes are encoded once (``Workload``), responses are parsed by httptools,
a streamed answer's events are counted, not decoded. Lifecycle of a measurement (``Driver.run``):
close idle connections and open fresh ones (kept-alive; a server may have timed the old ones out)
-> read the measured process's CPU -> send ``rate`` requests/s for ``seconds`` on a fixed
schedule (a slow answer never delays the next send; how late each send left is recorded, so an
overloaded generator shows) -> wait for the answers (``timeout_s``, then the rest count as
errors) -> read the CPU again -> ``Samples``.

What is timed: non-streaming, the whole answer; streaming, the first bytes of the answer (TTFT)
and how late the last event came against the stand-in's schedule (``max_tokens * interval`` after
the request), which catches a delay of any event that the relay never caught up on.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httptools

from bench.relay_http import HttpConnection

DONE_TAIL = b"data: [DONE]\n\n"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant (a proxy that forks workers is measured whole)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{current}/task/{tid}/children") as f:
                    todo += [int(child) for child in f.read().split()]
            except OSError:
                pass
    return found


CpuSnapshot = dict[tuple[int, int], int]  # (pid, thread id) -> ns on a CPU


def cpu_snapshot(pids: list[int], *, descendants: bool = True) -> CpuSnapshot:
    """Every thread's on-CPU time (``schedstat``, ns) in ``pids`` and (``descendants``) every
    process they started."""
    found: CpuSnapshot = {}
    for root in pids:
        for pid in process_tree(root) if descendants else [root]:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        found[(pid, int(tid))] = int(f.read().split()[0])
                except OSError:
                    continue
    return found


def load_snapshot(load_pids: list[int]) -> CpuSnapshot:
    """The load side's threads: ``load_pids`` with their descendants (the stand-in), and this
    process's own -- not the processes it started, which are the relays measured, Redis and
    PostgreSQL: counted as load, a relay busy at its own limit made the generator look busy."""
    return {**cpu_snapshot(load_pids), **cpu_snapshot([os.getpid()], descendants=False)}


def cpu_between(before: CpuSnapshot, after: CpuSnapshot) -> float:
    """CPU seconds spent between two snapshots. A thread born in between counts from zero; one
    that ended in between counts nothing (the servers measured keep their threads; a worker
    thread that ends has been idle for seconds before)."""
    return sum(ns - before.get(key, 0) for key, ns in after.items()) / 1e9


@dataclass(frozen=True, slots=True)
class Workload:
    """Encoded requests, sent in turn (one per tenant key, for instance)."""

    requests: tuple[bytes, ...]
    stream: bool
    tokens: int  # max_tokens: a streamed answer has tokens + 3 events from the stand-in
    interval_s: float = 0.0  # the stand-in's time between streamed tokens

    @property
    def events(self) -> int:
        return self.tokens + 3


def chat_request(
    host: str,
    *,
    model: str,
    key: str | None,
    content: str,
    tokens: int,
    stream: bool,
) -> bytes:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": stream,
        }
    ).encode()
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n{auth}"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@dataclass(slots=True)
class Samples:
    """One measurement: latencies of the good answers, errors, CPU of the measured process."""

    sent: int = 0
    ok: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)  # streaming: the last event's lateness
    ttfts_ms: list[float] = field(default_factory=list)
    lag_ms: list[float] = field(default_factory=list)  # how late each send left
    events: int = 0  # events received (streaming)
    wall_s: float = 0.0
    cpu_s: float | None = None
    load_cpu_s: float = 0.0  # the generator's own CPU (and the stand-in's) over the run

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q)

    def achieved(self) -> float:
        return self.ok / self.wall_s if self.wall_s else 0.0


class Conn(HttpConnection):
    """One kept-alive client connection; one request at a time."""

    def __init__(self, driver: Driver) -> None:
        super().__init__(httptools.HttpResponseParser)
        self.driver = driver
        self.samples: Samples | None = None
        self.busy = False
        self.status = 0
        self.sent_at = 0.0
        self.first_at = 0.0
        self.events = 0
        self.tail = b""
        self.stream = False
        self.lateness_s = 0.0

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.busy:
            self._end(ok=False)

    def send(self, request: bytes, samples: Samples, workload: Workload) -> None:
        self.busy, self.samples, self.status = True, samples, 0
        self.first_at, self.events, self.tail = 0.0, 0, b""
        self.stream = workload.stream
        self.lateness_s = workload.tokens * workload.interval_s
        self.sent_at = time.perf_counter()
        assert self.transport is not None
        self.transport.write(request)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self.first_at:
            self.first_at = time.perf_counter()
        if self.stream:
            self.events += body.count(b"\n\n")
            self.tail = (self.tail + body)[-len(DONE_TAIL) :]

    def on_message_complete(self) -> None:
        ok = self.status == 200 and (not self.stream or self.tail == DONE_TAIL)
        self._end(ok=ok)
        if self.transport is not None and not self.parser.should_keep_alive():
            self.transport.close()

    def _end(self, *, ok: bool) -> None:
        samples = self.samples
        self.busy, self.samples = False, None
        if samples is None:
            return
        now = time.perf_counter()
        if ok:
            samples.ok += 1
            if self.stream:
                samples.latencies_ms.append((now - self.sent_at - self.lateness_s) * 1000)
                samples.ttfts_ms.append((self.first_at - self.sent_at) * 1000)
                samples.events += self.events
            else:
                samples.latencies_ms.append((now - self.sent_at) * 1000)
        else:
            samples.errors += 1
        self.driver.finished(self)


class Driver:
    """Connections to one target (host, port) and the open-loop sender."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[Conn] = []
        self.active: set[Conn] = set()  # waiting for an answer
        self.outstanding = 0
        self._drained: asyncio.Event | None = None
        self._closed: list[Any] | None = None  # closed loop: [until, workload, samples, count]

    async def _open(self) -> Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: Conn(self), self.host, self.port)
        return conn

    async def fresh(self, count: int) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle = []
        for start in range(0, count, 64):
            batch = min(64, count - start)
            self.idle += await asyncio.gather(*(self._open() for _ in range(batch)))

    def finished(self, conn: Conn) -> None:
        self.active.discard(conn)
        self.outstanding -= 1
        closed = self._closed
        if closed is not None and time.perf_counter() < closed[0]:
            workload, samples = closed[1], closed[2]
            closed[3] += 1
            self._send(workload.requests[closed[3] % len(workload.requests)], samples, workload)
            samples.sent += 1
        if conn.transport is not None and not conn.transport.is_closing():
            self.idle.append(conn)
        if self.outstanding == 0 and self._drained is not None:
            self._drained.set()

    def _send(self, request: bytes, samples: Samples, workload: Workload) -> None:
        self.outstanding += 1
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                self.active.add(conn)
                conn.send(request, samples, workload)
                return
        asyncio.get_running_loop().create_task(self._send_new(request, samples, workload))

    async def _send_new(self, request: bytes, samples: Samples, workload: Workload) -> None:
        try:
            conn = await self._open()
        except OSError:
            samples.errors += 1
            self.outstanding -= 1
            if self.outstanding == 0 and self._drained is not None:
                self._drained.set()
            return
        self.active.add(conn)
        conn.send(request, samples, workload)

    async def run(
        self,
        workload: Workload,
        *,
        rate: float,
        seconds: float,
        cpu_pids: list[int],
        load_pids: list[int],
        timeout_s: float = 15.0,
    ) -> Samples:
        """Send ``rate`` requests/s for ``seconds``; CPU of ``cpu_pids`` (summed) over the run."""
        count = max(1, int(rate * seconds))
        expected = workload.tokens * workload.interval_s if workload.stream else 0.005
        await self.fresh(min(count, int(rate * (expected + 0.05) * 1.5) + 8))
        samples = Samples(sent=count)
        self._drained = None
        cpu_before = cpu_snapshot(cpu_pids)
        load_before = load_snapshot(load_pids)
        start = time.perf_counter() + 0.01
        requests = workload.requests
        i = 0
        while i < count:
            now = time.perf_counter()
            due = start + i / rate
            if due > now:  # the loop's timers tick in ms: a shorter sleep would spin
                await asyncio.sleep(max(due - now, 0.001))
                continue
            samples.lag_ms.append((now - due) * 1000)
            self._send(requests[i % len(requests)], samples, workload)
            i += 1
        if self.outstanding:
            self._drained = asyncio.Event()
            try:
                await asyncio.wait_for(self._drained.wait(), timeout_s)
            except TimeoutError:
                self._abandon(samples)
        samples.wall_s = time.perf_counter() - start
        if cpu_pids:
            samples.cpu_s = cpu_between(cpu_before, cpu_snapshot(cpu_pids))
        samples.load_cpu_s = cpu_between(load_before, load_snapshot(load_pids))
        return samples

    async def closed(self, workload: Workload, *, clients: int, seconds: float) -> Samples:
        """``clients`` back-to-back senders for ``seconds`` (saturating the target: profiles)."""
        await self.fresh(clients)
        samples = Samples(sent=clients)
        start = time.perf_counter()
        self._closed = [start + seconds, workload, samples, 0]
        for i in range(clients):
            self._send(workload.requests[i % len(workload.requests)], samples, workload)
        await asyncio.sleep(seconds)
        self._closed = None
        if self.outstanding:
            self._drained = asyncio.Event()
            try:
                await asyncio.wait_for(self._drained.wait(), 30)
            except TimeoutError:
                self._abandon(samples)
        samples.wall_s = time.perf_counter() - start
        return samples

    def _abandon(self, samples: Samples) -> None:
        """Answers still missing after the timeout: errors; their connections are closed."""
        samples.errors += self.outstanding
        self.outstanding = 0
        for conn in list(self.active):
            conn.samples, conn.busy = None, False
            if conn.transport is not None:
                conn.transport.close()
        self.active.clear()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def describe(samples: Samples) -> dict[str, Any]:
    """A short summary of one measurement, for logs."""
    return {
        "ok": samples.ok,
        "errors": samples.errors,
        "p50": round(percentile(samples.latencies_ms, 0.5), 2),
        "p99": round(percentile(samples.latencies_ms, 0.99), 2),
        "lag_p99": round(percentile(samples.lag_ms, 0.99), 2),
        "cpu_s": samples.cpu_s,
    }
