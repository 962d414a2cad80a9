"""The lower-severity checks: counts and timings that a leaked answer tends to get wrong.

Pure: no I/O, no clock (times are given).

- ``usage_anomaly``: the engine's ``usage.prompt_tokens`` against the gateway's own count. On an
  engine the gateway counts exactly (its own tokenizer endpoint) any difference is a finding; on a
  declared engine the gateway's count is an upper bound, so only *more* is. An engine that read
  more prompt than it was sent, or answered a 1-token placeholder instead of the prompt (the
  incident), shows up here.
- ``FirstTokenCalibrator``: a first token that arrives implausibly fast for the prompt's size.
  Per engine it keeps the recent seconds-per-prompt-token of streamed requests whose prompt has at
  least ``min_prompt_tokens`` tokens; once it has ``min_samples``, a request whose rate is below
  ``ratio`` x the history's 10th percentile is a finding. The baseline is a low quantile, not the
  median, because queueing under load only ever makes first tokens slower: the fast end of the
  history is the engine's real prefill speed. Every sample is learnt, flagged or not, so a
  genuinely faster engine (an upgrade) stops being flagged within a tenth of the window, after
  its first requests were reported. The incident's leaked answers skipped the prefill of a long
  prompt, so they came back in a small fraction of the time the engine needs for that size.
  Prefix caching makes honest requests fast too: the default ratio (0.2) leaves a wide margin,
  the finding is low severity, and the check can be turned off (``canary_ttft_check``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

BASELINE_QUANTILE = 0.1


@dataclass(frozen=True, slots=True)
class Anomaly:
    detail: str  # numbers only


def usage_anomaly(*, gateway_count: int, engine_count: int, exact: bool) -> Anomaly | None:
    if engine_count == gateway_count or (not exact and engine_count < gateway_count):
        return None
    how = "exact" if exact else "upper bound"
    return Anomaly(
        f"gateway counted {gateway_count} prompt tokens ({how}), engine reported {engine_count}"
    )


class FirstTokenCalibrator:
    def __init__(
        self, *, min_prompt_tokens: int, ratio: float, history: int, min_samples: int
    ) -> None:
        if not 0 < ratio < 1 or min_samples > history:
            raise ValueError("ratio must be in (0, 1) and min_samples <= history")
        self._min_prompt = min_prompt_tokens
        self._ratio = ratio
        self._history = history
        self._min_samples = min_samples
        self._rates: dict[str, deque[float]] = {}

    def samples(self, engine: str) -> int:
        return len(self._rates.get(engine, ()))

    def observe(self, engine: str, *, prompt_tokens: int, first_token_s: float) -> Anomaly | None:
        """Judge one streamed request against the engine's history, then learn from it."""
        if prompt_tokens < self._min_prompt or first_token_s < 0:
            return None
        rates = self._rates.setdefault(engine, deque(maxlen=self._history))
        rate = first_token_s / prompt_tokens
        anomaly = None
        if len(rates) >= self._min_samples:
            ordered = sorted(rates)
            typical = ordered[int(BASELINE_QUANTILE * (len(ordered) - 1))]
            if rate < self._ratio * typical:
                anomaly = Anomaly(
                    f"first token after {first_token_s * 1000:.1f} ms for {prompt_tokens} prompt "
                    f"tokens; this engine's fast end is {typical * 1e6:.1f} us/token, "
                    f"this request {rate * 1e6:.2f} us/token"
                )
        rates.append(rate)
        return anomaly
