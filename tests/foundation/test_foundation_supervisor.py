"""`kvguard up`'s supervisor with real child processes: ordered start, health, clean stop."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading

from kvguard.localservices import free_port
from kvguard.supervisor import RoleSpec, Supervisor
from kvguard.testing import wait_for


def _http_role(name: str, port: int) -> RoleSpec:
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    return RoleSpec(name=name, argv=argv, url=f"http://127.0.0.1:{port}", health_path="/")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_dying_role_stops_the_stack_and_is_named() -> None:
    roles = [_http_role("first", free_port()), _http_role("second", free_port())]
    out = io.StringIO()
    sup = Supervisor(roles, out=out)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run("banner")))
    thread.start()
    wait_for(lambda: "all roles healthy" in out.getvalue(), 30, "both roles healthy")
    pids = [r.proc.pid for r in sup._running]
    os.kill(pids[1], signal.SIGKILL)
    thread.join(timeout=30)
    assert result == [1]
    assert "role 'second' exited with status -9" in out.getvalue()
    wait_for(lambda: not _alive(pids[0]), 10, "the surviving role stopped too")


# A role whose health check answers 200 "ok" until the file named by its argument exists, then
# 503 "failed" (as an engine whose loop failed, or a gateway whose background task ended, does).
FAILING_ROLE = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        failed = os.path.exists(sys.argv[2])
        body = {"status": "ok"}
        if failed:
            body = {"status": "failed", "error": "engine loop failed: OSError"}
        raw = json.dumps(body).encode()
        self.send_response(503 if failed else 200)
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_role_that_reports_itself_failed_stops_the_stack_and_is_named(tmp_path) -> None:
    port, trigger = free_port(), tmp_path / "fail"
    engine = RoleSpec(
        name="engine",
        argv=[sys.executable, "-c", FAILING_ROLE, str(port), str(trigger)],
        url=f"http://127.0.0.1:{port}",
    )
    roles = [_http_role("first", free_port()), engine]
    out = io.StringIO()
    sup = Supervisor(roles, out=out, health_every_s=0.2)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run("banner")))
    thread.start()
    wait_for(lambda: "all roles healthy" in out.getvalue(), 30, "both roles healthy")
    pids = [r.proc.pid for r in sup._running]
    trigger.touch()
    thread.join(timeout=30)
    assert result == [1]
    assert "role 'engine' reports itself failed: engine loop failed: OSError" in out.getvalue()
    wait_for(lambda: not any(_alive(pid) for pid in pids), 10, "every role stopped")


def test_a_role_that_fails_at_start_up_stops_the_earlier_ones() -> None:
    good = _http_role("good", free_port())
    bad = RoleSpec(
        name="bad",
        argv=[sys.executable, "-c", "raise SystemExit(3)"],
        url=f"http://127.0.0.1:{free_port()}",
    )
    out = io.StringIO()
    assert Supervisor([good, bad], out=out).run() == 1
    assert "role 'bad' exited with status 3 during start-up" in out.getvalue()


def test_sigterm_stops_every_role_with_status_zero(tmp_path: object) -> None:
    port = free_port()
    script = (
        "import sys; from kvguard.supervisor import RoleSpec, Supervisor\n"
        f"role = RoleSpec('web', [sys.executable, '-m', 'http.server', '{port}', '--bind',"
        f" '127.0.0.1'], 'http://127.0.0.1:{port}', health_path='/')\n"
        "sys.exit(Supervisor([role]).run())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C" in line:
            break
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert any("all roles healthy" in line for line in lines)


def test_cli_help_lists_the_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvguard", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "up" in out
