"""The SGLang/vLLM dashboard against a real Prometheus scraping stand-in engine /metrics.

The stand-ins serve the expositions in tests/ops/fixtures (built from vLLM's and SGLang's own
metric definitions, see the README there), counters and histograms growing with each scrape so
rates have two samples. They are scraped as the gateway's engines are (``engine_targets``: an
``engine`` label with the routed name, a ``role``), which also exercises Prometheus renaming
vLLM's own ``engine`` label. Every panel must evaluate and return data.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ops_stack import prom_query

from dashboards.build import engine_targets, scrape_config
from dashboards.engines import ENGINES
from kvguard.localservices import prometheus_server

FIXTURES = Path(__file__).parent / "fixtures"
GROWING = re.compile(r"^(\S+?(?:_total|_bucket|_count|_sum)(?:\{[^}]*\})?) (\S+)$")
VARIABLES = {"$__rate_interval": "4s", "$engine": ".*"}


def _exposition(text: str, scrape: int) -> str:
    """The fixture at its ``scrape``-th scrape: cumulative series multiplied by it."""
    lines = []
    for line in text.splitlines():
        m = GROWING.match(line)
        lines.append(f"{m.group(1)} {float(m.group(2)) * scrape}" if m else line)
    return "\n".join(lines) + "\n"


@contextmanager
def standin_metrics(fixture: str) -> Iterator[str]:
    """host:port of an HTTP server answering /metrics with ``fixture`` (a stand-in engine)."""
    text = (FIXTURES / fixture).read_text()
    scrapes = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            scrapes[0] += 1
            body = _exposition(text, scrapes[0]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _wait_for(prometheus: str, expr: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not prom_query(prometheus, expr)["data"]["result"]:
        assert time.monotonic() < deadline, f"no data for {expr} within {timeout_s} s"
        time.sleep(0.2)


def test_every_engine_panel_shows_data_from_sglang_and_vllm_shaped_metrics() -> None:
    with (
        standin_metrics("third_party_vllm_metrics.txt") as vllm,
        standin_metrics("third_party_sglang_metrics.txt") as sglang,
    ):
        targets = engine_targets("vllm-pool", [("unified", vllm)])
        targets += engine_targets("sglang-pd", [("decode", sglang)])
        with prometheus_server(scrape_config(targets, [], interval="1s")) as prom:
            # Two scrapes of each inside the rate window: rate() sees growth.
            _wait_for(prom.url, "count_over_time(vllm:prompt_tokens_total[1m]) >= 2")
            _wait_for(prom.url, "count_over_time(sglang:prompt_tokens_total[1m]) >= 2")
            empty, errors = [], []
            for panel in ENGINES.panels:
                results = []
                for query in panel.queries:
                    expr = query.expr
                    for name, value in VARIABLES.items():
                        expr = expr.replace(name, value)
                    answer = prom_query(prom.url, expr)
                    if answer["status"] != "success":
                        errors.append(f"{panel.title}: {answer.get('error')}")
                    results += answer.get("data", {}).get("result", [])
                if not results:
                    empty.append(panel.title)
            assert errors == []
            assert empty == []
            kept = prom_query(prom.url, "vllm:num_requests_running")["data"]["result"]
            (series,) = kept
            assert series["metric"]["engine"] == "vllm-pool"
            assert series["metric"]["exported_engine"] == "0"
