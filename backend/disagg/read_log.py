"""The drill read log: what a request's prompt pages held when decode accepted its KV, and when
the request ended (page fingerprints, no content), for drills and their tests.

Kept only when fault drills are allowed (``/engine/drill/kv-reads``): a late write that reached a
page after its checks shows as a fingerprint that changed between the two. The engine thread
writes it; ``snapshot`` may be taken from any thread.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any

from backend.disagg.kvio import page_fingerprints
from backend.disagg.machines import Expectation
from backend.model.kv_cache import KVCache

KEEP = 256  # the newest requests' entries


class ReadLog:
    def __init__(self, kv: KVCache) -> None:
        self._kv = kv
        self._entries: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return copy.deepcopy(list(self._entries.values()))

    def accepted(self, request_id: str, expect: Expectation) -> None:
        ids = [g.page_id for g in expect.grants]
        prints = page_fingerprints(self._kv, ids, expect.reserved_tokens)
        entry = {
            "request_id": request_id,
            "reserved_tokens": expect.reserved_tokens,
            "pages": [
                {"page_id": g.page_id, "generation": g.generation, "at_accept": fp}
                for g, fp in zip(expect.grants, prints, strict=True)
            ],
        }
        with self._lock:
            self._entries[request_id] = entry
            while len(self._entries) > KEEP:
                self._entries.popitem(last=False)

    def finished(self, request_id: str) -> None:
        entry = self._entries.get(request_id)
        if entry is None:
            return
        ids = [page["page_id"] for page in entry["pages"]]
        prints = page_fingerprints(self._kv, ids, entry["reserved_tokens"])
        with self._lock:
            for page, fp in zip(entry["pages"], prints, strict=True):
                page["at_finish"] = fp
