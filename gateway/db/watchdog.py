"""A bound on every PostgreSQL round trip, even when the server is frozen.

A server that stopped (SIGSTOP, a hung host, a stalled disk) keeps its sockets open: the kernel
accepts and acknowledges, nothing answers, and a blocking driver call waits for ever. The server's
own ``statement_timeout`` cannot help (nothing runs there), and TCP keepalives are answered by the
kernel. So the gateway bounds each operation from its side:

- connecting: the driver's ``connect_timeout`` (whole seconds, at least 2: libpq's rule);
- waiting for a pooled connection: the pool's ``pool_timeout``;
- everything on an open connection -- the liveness ping at checkout, each statement, commit,
  rollback, the reset on return -- is *armed* here with a deadline when it starts and disarmed
  when it ends. A monitor thread shuts down the socket of any connection still busy past its
  deadline: the blocked call returns at once with an ``OperationalError`` (a disconnect, so the
  pool discards that connection), which the gateway answers as its documented 503.

Lifecycle: ``install(engine, budget_s)`` once per engine (PostgreSQL only) -> the events arm and
disarm around each operation -> the monitor thread (daemon, started on first use) sleeps while
nothing is armed. Work on a raw driver cursor (``gateway.db.copy``: COPY) runs outside the events:
it arms the engine's watchdog (``of(engine)``) itself.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.exc import DisconnectionError

log = logging.getLogger("kvguard.gateway.db")
_TICK_S = 0.05
_INSTALLED: weakref.WeakKeyDictionary[Engine, Watchdog] = weakref.WeakKeyDictionary()


class Watchdog:
    """Connections busy in one operation, with their deadlines; kills the overdue ones."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self._busy: dict[int, tuple[float, Any]] = {}  # id(dbapi conn) -> (deadline, conn)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.killed = 0

    def arm(self, dbapi_connection: Any) -> None:
        with self._lock:
            self._busy[id(dbapi_connection)] = (
                time.monotonic() + self.budget_s,
                dbapi_connection,
            )
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="db-watchdog", daemon=True)
                self._thread.start()
        self._wake.set()

    def disarm(self, dbapi_connection: Any) -> None:
        with self._lock:
            self._busy.pop(id(dbapi_connection), None)

    def _run(self) -> None:
        while True:
            with self._lock:
                idle = not self._busy
                if idle:
                    self._wake.clear()
            if idle:
                self._wake.wait()
                continue
            time.sleep(_TICK_S)
            now = time.monotonic()
            with self._lock:
                overdue = [conn for deadline, conn in self._busy.values() if deadline <= now]
                for conn in overdue:
                    self._busy.pop(id(conn), None)
            for conn in overdue:
                self._kill(conn)

    def _kill(self, dbapi_connection: Any) -> None:
        if cut(dbapi_connection):
            self.killed += 1
            log.warning(
                "database operation exceeded %.1f s: connection cut (the server is not answering)",
                self.budget_s,
            )


def cut(dbapi_connection: Any) -> bool:
    """Shut down the socket of a driver connection (anything with ``fileno``): a call blocked on
    it returns at once with a disconnect. False when it was closed already (nothing to cut)."""
    try:
        fd = dbapi_connection.fileno()
        duplicate = socket.socket(fileno=os.dup(fd))
    except Exception:  # already closed: nothing to cut
        return False
    try:
        duplicate.shutdown(socket.SHUT_RDWR)  # the socket, not just this descriptor
    except OSError:
        pass
    finally:
        duplicate.close()
    return True


def install(engine: Engine, budget_s: float) -> Watchdog:
    """Arm every operation of ``engine``'s connections with ``budget_s`` (PostgreSQL engines made
    without ``pool_pre_ping``: the checkout ping here is the armed one)."""
    watchdog = _INSTALLED[engine] = Watchdog(budget_s)

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        watchdog.arm(dbapi_connection)
        try:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("SELECT 1")
            finally:
                cursor.close()
        except Exception as exc:
            raise DisconnectionError("the pooled connection did not answer a ping") from exc
        finally:
            watchdog.disarm(dbapi_connection)

    # An invalidated connection (cut, or broken under a statement) has no driver connection to
    # arm: asking for it raises. Its rollback still fires the event; checkin disarms.
    def arm_connection(conn: Any, *_args: Any) -> None:
        if not conn.invalidated:
            watchdog.arm(conn.connection.dbapi_connection)

    def disarm_connection(conn: Any, *_args: Any) -> None:
        if not conn.invalidated:
            watchdog.disarm(conn.connection.dbapi_connection)

    def arm_raw(dbapi_connection: Any, *_args: Any) -> None:
        watchdog.arm(dbapi_connection)

    def disarm_raw(dbapi_connection: Any, *_args: Any) -> None:
        watchdog.disarm(dbapi_connection)

    def disarm_failed(context: Any) -> None:
        try:
            raw = context.connection.connection.dbapi_connection
        except Exception:  # no connection, or already invalidated: checkin disarms
            return
        if raw is not None:
            watchdog.disarm(raw)

    event.listen(engine, "before_cursor_execute", arm_connection)
    event.listen(engine, "after_cursor_execute", disarm_connection)
    event.listen(engine, "commit", arm_connection)  # disarmed at checkin or the next statement
    event.listen(engine, "rollback", arm_connection)
    event.listen(engine, "handle_error", disarm_failed)
    event.listen(engine, "reset", arm_raw)  # the pool's rollback when a connection returns
    event.listen(engine, "checkin", disarm_raw)
    return watchdog


def of(engine: Engine) -> Watchdog | None:
    """The watchdog ``install`` put on ``engine`` (None: unbounded, or not PostgreSQL)."""
    return _INSTALLED.get(engine)
