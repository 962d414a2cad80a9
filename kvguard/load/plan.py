"""The load plan: the one typed message from ``kvguard load`` (setup) to its Locust worker process.

The parent builds it (tenants and their keys, the model, the calibrated size classes, the bounds),
writes it as JSON to a file only its user can read in a private temporary directory, and starts
the worker with that path; the worker reads it back with ``LoadPlan.load``. Keys never appear in a
repr, a log line or the output directory.

The markers' keyring is not in the plan: the parent hands the worker the very keyring it calibrated
with on the worker's standard input (``keyring_text`` / ``read_keyring``), so the canary's key is
never written to disk and the worker cannot mint markers under another key than its caller's (its
own environment may name none, or another: the gateway then sees markers it cannot verify, and
strips them from every answer).

Each request's marker nonce is derived from the run's ``marker_seed`` and the request's slot
(``marker_nonce``): a run is drawn a fresh seed, and the same plan with the same seed sends the
very same markers again, which replays a failed run request for request. A plan written for
Locust's own CLI (``--write-plan``) carries no seed unless one is asked for: a plan reused run
after run must not send the same markers twice, or a stale answer from an earlier run would pass
as this run's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from canary.markers import NONCE_BYTES, MarkerKeyring

SIZE_NAMES = ("short", "mid", "near", "over", "over_prompt")
# Opt-in: a short request that carries another load tenant's marker; the gateway must refuse it.
ALL_SIZE_NAMES = (*SIZE_NAMES, "foreign")


@dataclass(frozen=True, slots=True)
class LoadTenant:
    id: str
    name: str
    key: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class SizeClass:
    """One prompt size of the run: the filler that makes the prompt, and what must come back.

    ``prompt_tokens`` is the engine's own count of this prompt (measured during calibration; for
    ``over_prompt``, which is refused, an estimate that exceeds the limit);
    ``prompt_tokens + max_tokens`` is what the gateway admits against the limit.
    """

    name: str
    filler_chars: int
    max_tokens: int
    prompt_tokens: int
    expected_status: int
    expected_code: str | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True, slots=True)
class LoadPlan:
    gateway: str
    model: str
    limit: int
    tenants: tuple[LoadTenant, ...]
    sizes: tuple[SizeClass, ...]
    out_dir: str
    users: int
    spawn_rate: float
    duration_s: float
    max_requests: int | None
    request_timeout_s: float
    stop_timeout_s: float
    prompt_slack: int = 0
    byte_tokens: bool = False
    marker_seed: int | None = None  # None: each run draws its own

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoadPlan:
        tenants = tuple(LoadTenant(**t) for t in data.pop("tenants"))
        sizes = tuple(SizeClass(**s) for s in data.pop("sizes"))
        return cls(tenants=tenants, sizes=sizes, **data)

    def save(self, path: Path) -> None:
        """Write the plan readable by this user only (it holds tenant keys)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(self.to_json(), out)

    @classmethod
    def load(cls, path: Path) -> LoadPlan:
        return cls.from_json(json.loads(path.read_text()))


def draw_marker_seed() -> int:
    return secrets.randbits(63)


def marker_nonce(seed: int, slot: int) -> bytes:
    """The marker nonce of the run's ``slot``-th request: a keyed BLAKE2b of the slot, so slots
    get different nonces (64 bits: a collision is negligible) that nobody predicts without the
    seed."""
    key = seed.to_bytes(8, "big")
    digest = hashlib.blake2b(slot.to_bytes(8, "big"), key=key, digest_size=NONCE_BYTES)
    return digest.digest()


def keyring_text(keyring: MarkerKeyring) -> str:
    """The keyring as JSON (secrets in hex), for the worker's standard input only."""
    keys = {str(key_id): (keyring.get(key_id) or b"").hex() for key_id in keyring.key_ids}
    return json.dumps({"current": keyring.current_id, "keys": keys})


def read_keyring(text: str) -> MarkerKeyring:
    data = json.loads(text)
    keys = {int(key_id): bytes.fromhex(secret) for key_id, secret in data["keys"].items()}
    return MarkerKeyring(keys, current=int(data["current"]))
