"""A Locust load shape for long-context runs: short prompts -> near the limit -> over the limit.

Use it with the shipped locustfile (Locust takes the shape from any file it is given)::

    locust -f kvguard/load/locustfile.py,kvguard/load/shape.py --host http://GATEWAY \
        --kvguard-plan plan.json -u 8 --kvguard-stage-seconds 60

Each stage lasts ``--kvguard-stage-seconds`` and narrows the users' requests to its size classes
(``kvguard.load.stage``); users ramp to ``-u`` over the first stage and stay there. The run stops
after the last stage. Nothing here imports the locustfile: Locust loads each file as a module of
its own, and a second copy of the user class would be a second user class.
"""

from __future__ import annotations

from typing import Any

from locust import LoadTestShape

from kvguard.load.stage import CURRENT_STAGE, RAMP_STAGES

DEFAULT_STAGE_S = 20.0


class LongContextRamp(LoadTestShape):
    """short -> near-limit -> over-limit (``RAMP_STAGES``), ``-u`` users, then stop."""

    use_common_options = True  # -u and -r come from the command line (or the web UI)

    def tick(self) -> tuple[int, float] | None:
        options: Any = self.runner.environment.parsed_options if self.runner else None
        stage_s = float(getattr(options, "kvguard_stage_seconds", DEFAULT_STAGE_S))
        users = max(1, int(getattr(options, "num_users", None) or 1))
        rate = float(getattr(options, "spawn_rate", None) or users)
        index = int(self.get_run_time() // stage_s)
        if index >= len(RAMP_STAGES):
            CURRENT_STAGE.sizes = None
            return None
        CURRENT_STAGE.sizes = RAMP_STAGES[index]
        return users, rate
