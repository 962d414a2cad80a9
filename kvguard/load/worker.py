"""The Locust worker process of ``kvguard load``: ``python -m kvguard.load.worker PLAN.json
[--keyring-stdin]`` (the markers' keyring as JSON on stdin, ``kvguard.load.plan.read_keyring``;
without it, the canary settings of the worker's own environment).

A separate process because Locust monkey-patches the standard library with gevent on import;
``kvguard load`` (the parent) stays gevent-free. Lifecycle: read the plan -> import the locustfile
(gevent patches here) -> a Locust ``Environment`` with a local runner, ``plan.users`` users
spawned at ``plan.spawn_rate`` -> stop when the duration passes or the request budget is spent
and no request is in flight (users finish their current request, up to ``plan.stop_timeout_s``)
-> write, under ``plan.out_dir``: Locust's CSVs (``locust_stats.csv``, ``locust_failures.csv``,
``locust_exceptions.csv``, and ``locust_stats_history.csv``, a row per second and per request
name, written while the run goes, when every user runs and at its end), its HTML report
(``locust.html``), one JSON line per request (``samples.jsonl``) and the run's wall time
(``run.json``). While it runs it
prints a progress line every ``PROGRESS_INTERVAL_S`` to stderr (the terminal of ``kvguard load``;
Locust's own log goes to stdout, the parent's ``worker.log``). The exit status only says whether
the run itself worked; the parent judges the results.
"""

from __future__ import annotations

import csv
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

WATCH_INTERVAL_S = 0.05
PROGRESS_INTERVAL_S = 2.0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    from_stdin = "--keyring-stdin" in args
    args = [arg for arg in args if arg != "--keyring-stdin"]
    if len(args) != 1:
        print("usage: python -m kvguard.load.worker PLAN.json [--keyring-stdin]", file=sys.stderr)
        return 2
    keyring_json = sys.stdin.read() if from_stdin else None
    logging.basicConfig(stream=sys.stdout, level=logging.INFO)
    import gevent
    from locust.env import Environment
    from locust.html import get_html_report
    from locust.stats import PERCENTILES_TO_REPORT, StatsCSVFileWriter, stats_history

    from kvguard.load import locustfile
    from kvguard.load.plan import LoadPlan, read_keyring
    from kvguard.load.report import progress_line, write_samples

    plan = LoadPlan.load(Path(args[0]))
    out = Path(plan.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keyring = None if keyring_json is None else read_keyring(keyring_json)
    ctx = locustfile.LoadContext.from_plan(plan, keyring=keyring)
    locustfile.ChatUser.ctx = ctx
    env = Environment(
        user_classes=[locustfile.ChatUser],
        host=plan.gateway,
        stop_timeout=plan.stop_timeout_s,
        locustfile=locustfile.__file__,
    )
    runner = env.create_local_runner()
    history = gevent.spawn(stats_history, runner)
    tables = StatsCSVFileWriter(env, PERCENTILES_TO_REPORT, str(out / "locust"), full_history=True)
    writer = gevent.spawn(tables.stats_writer)

    def history_rows(**_: object) -> None:
        tables._stats_history_data_rows(tables.stats_history_csv_writer, time.time())

    # The writer appends a row set once a second; a run shorter than that would hold only its
    # first, empty rows: the history also gets one when every user is running and one at the end.
    env.events.spawning_complete.add_listener(history_rows)
    started = time.time()
    runner.start(plan.users, spawn_rate=plan.spawn_rate)

    def watch() -> None:
        deadline = time.monotonic() + plan.duration_s
        while time.monotonic() < deadline and not ctx.budget.exhausted:
            gevent.sleep(WATCH_INTERVAL_S)
        runner.quit()

    def progress() -> None:
        while True:
            gevent.sleep(PROGRESS_INTERVAL_S)
            line = progress_line(
                ctx.samples, elapsed_s=time.time() - started, users=runner.user_count
            )
            print(line, file=sys.stderr, flush=True)

    gevent.spawn(watch)
    ticker = gevent.spawn(progress)
    runner.greenlet.join()
    wall_s = time.time() - started
    ticker.kill(block=True)
    history.kill(block=True)
    writer.kill(block=True)
    history_rows()  # the final counts
    tables.close_files()
    for name, write in (  # the final tables (the writer refreshes them once a second)
        ("stats", tables.requests_csv),
        ("failures", tables.failures_csv),
        ("exceptions", tables.exceptions_csv),
    ):
        with (out / f"locust_{name}.csv").open("w", newline="") as f:
            write(csv.writer(f))
    print(progress_line(ctx.samples, elapsed_s=wall_s, users=0), file=sys.stderr, flush=True)
    (out / "locust.html").write_text(get_html_report(env, show_download_link=False))
    write_samples(out / "samples.jsonl", ctx.samples)
    run = {"started_at": started, "wall_s": wall_s, "users": plan.users}
    run["issued"] = ctx.budget.issued  # minus the samples: requests cut off by the stop timeout
    (out / "run.json").write_text(json.dumps(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
