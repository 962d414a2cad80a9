"""Does the bundled model copy the load tests' seeded markers whole? (run by hand, ~2 min)

    python tests/load/copy_check.py [SLOTS]  (default: COPY_CHECKED_SLOTS)

The markers of ``test_load_run.py``'s tenants (the first two ids ``seeded_gateway.py`` draws
from ``TENANT_ID_SEED``) for slots 0..SLOTS-1 under ``MARKER_SEED``, each asked for in the load
prompt at the short, mid and near sizes its runs calibrate (0, 74 and 221 filler characters
under the 384-token limit), greedy through ``backend.bundled.modeling``. Prints every damaged
copy and the count; exits 1 if there is one. At ``TENANT_ID_SEED = MARKER_SEED = 1``: 300 slots,
1,800 copies, none damaged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from backend.bundled.chat import render
from backend.bundled.checkpoint import load_checkpoint
from backend.bundled.modeling import greedy_generate
from canary.markers import MarkerCodec, MarkerKeyring
from canary.probes import filler_text, reference_chat
from kvguard.load.plan import marker_nonce

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from seeded_gateway import seeded_ids  # noqa: E402
from test_load_run import (  # noqa: E402
    BUNDLED_MODEL,
    CANARY_KEY,
    COPY_CHECKED_SLOTS,
    MARKER_SEED,
    TENANT_ID_SEED,
)

FILLER_CHARS = {"short": 0, "mid": 74, "near": 221}
BOS = 256  # ids 0-255 are the bytes


def main(slots: int) -> int:
    torch.set_num_threads(1)
    model = load_checkpoint(BUNDLED_MODEL).eval()
    codec = MarkerCodec(MarkerKeyring({1: CANARY_KEY.encode()}, current=1))
    ids = seeded_ids(TENANT_ID_SEED)
    tenants = [f"tn_{ids.token_hex(8)}" for _ in range(2)]
    damaged = 0
    with torch.no_grad():
        for tenant in tenants:
            for slot in range(slots):
                marker = codec.issue(tenant, nonce=marker_nonce(MARKER_SEED, slot))
                for size, chars in FILLER_CHARS.items():
                    prompt = render(reference_chat(marker, filler=filler_text(chars)))
                    out = greedy_generate(model, [BOS, *prompt.encode()], 40)
                    got = bytes(t for t in out if t < BOS).decode("latin-1")
                    if got != marker.text:
                        damaged += 1
                        print(f"damaged: {tenant} slot {slot} {size}: {marker.text} -> {got}")
    print(f"{len(tenants) * slots * len(FILLER_CHARS)} copies, {damaged} damaged")
    return 1 if damaged else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else COPY_CHECKED_SLOTS))
