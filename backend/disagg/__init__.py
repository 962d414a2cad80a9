"""Disaggregated prefill/decode: the handoff that carries outcomes and proofs.

Read in this order:

- ``protocol``: the versioned messages and their codec, with the message-flow diagram
  (``wire``: its strict field reader).
- ``machines``: both sides' state machines as transition tables, decode's checks (positive
  evidence only), the drain bound, and the proof a response carries.
- ``faults``: the named fault drills and the one defence each removes.
- ``decode_scheduler``: decode's queues in front of the engine scheduler (pure).
- ``decode_core`` / ``decode_driver``: decode's engine-thread decisions and event-loop messaging;
  ``decode_checks``: its checks on a result, and ``read_log``: the drills' page fingerprints.
- ``prefill``: prefill's admission, compute, staging and transfer.
- ``channel`` and ``seal``: the sealed KV channel -- decode's landing slots, registered with the
  transport per handoff; every run of pages sealed with AES-256-GCM under the handoff's key;
  opened from a private copy and moved into the pool only after every check.
- ``kvio``: checksums, fingerprints, the staging area and the open channel's segments (tensors).

``protocol``, ``wire``, ``machines``, ``faults``, ``errors`` and ``decode_scheduler`` are pure (no
torch, HTTP or environment) so the model checker can drive exactly the code that runs.
"""
