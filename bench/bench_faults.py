"""Faults under load, as part of `make bench`: the table of `python -m bench.faults`.

Kills and restarts decode and prefill, cuts Redis and PostgreSQL, slows the KV transfer and
cancels a storm of streams while marker-checked clients run; see `bench.faults`.
"""

from __future__ import annotations

from bench.faults import main

if __name__ == "__main__":
    raise SystemExit(main())
