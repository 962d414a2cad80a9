"""``kvguard gateway`` whose tenant ids are drawn from a seeded generator (tests only).

    python tests/load/seeded_gateway.py SEED [kvguard gateway options]

A load run's markers follow from its tenants' ids, the canary key and its marker seed; with the
ids drawn from ``SEED`` and the seed passed to ``kvguard load``, a test's run sends the same
markers every time, and the bundled model's copies of them are the same every time. Drawn fresh,
the model damages about one marker in a few thousand (the firewall strips the damaged copy and
the check fails), which made the load tests fail now and then for no fault of the stack. Every
other draw (keys, the gateway's own markers) stays random.
"""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace

from gateway.services import tenants
from kvguard.cli import main


def seeded_ids(seed: int) -> SimpleNamespace:
    """A stand-in for ``secrets`` in ``gateway.services.tenants``: its ``token_hex`` only."""
    draws = random.Random(seed)
    return SimpleNamespace(token_hex=lambda n: draws.randbytes(n).hex())


if __name__ == "__main__":
    tenants.secrets = seeded_ids(int(sys.argv[1]))  # type: ignore[assignment]
    sys.exit(main(["gateway", *sys.argv[2:]]))
