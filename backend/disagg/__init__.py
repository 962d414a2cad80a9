"""Disaggregated prefill/decode: the handoff that carries outcomes and proofs.

Read in this order:

- ``protocol``: the versioned messages and their codec, with the message-flow diagram.
- ``machines``: both sides' state machines as transition tables, decode's checks (positive
  evidence only), the drain bound, and the proof a response carries.
- ``faults``: the named fault drills and the one defence each removes.
- ``decode_scheduler``: decode's queues in front of the engine scheduler (pure).
- ``decode_core`` / ``decode_driver``: decode's engine-thread decisions and event-loop messaging.
- ``prefill``: prefill's admission, compute, staging and transfer.
- ``kvio``: transfer segments, checksums, fingerprints and the staging area (tensors).

``protocol``, ``machines``, ``faults``, ``errors`` and ``decode_scheduler`` are pure (no torch,
HTTP or environment) so the model checker can drive exactly the code that runs.
"""
