"""The Locust user of ``kvguard load``: streamed chat completions that must echo their own marker.

Importing this module imports Locust, which monkey-patches the standard library with gevent: only
the load worker process (``kvguard.load.worker``) or a ``locust -f`` run ever imports it.

Lifecycle of one task (``ChatUser.chat``): take a slot from the shared ``Budget`` (the run's
request bound; none left -> the user stops) -> the slot picks a size class and a tenant so that
every tenant sends every size -> mint the slot's marker of that tenant with the canary key (its
nonce derived from the run's marker seed and the slot: ``kvguard.load.plan.marker_nonce``; a
genuine marker of the caller's own tenant is *carried*: the gateway delivers it back unstripped,
while a marker of another tenant is refused at the door and cut from any answer; the opt-in
``foreign`` size sends the next tenant's marker and expects that refusal) -> stream
the chat, timing every content chunk -> ``check_answer`` -> one Locust request event (response
time = end-to-end, failure = the checks' reasons) and one ``Sample`` for the summary.

Standalone, under Locust's own web UI or headless flags, against any kvguard gateway::

    locust -f kvguard/load/locustfile.py --host http://GATEWAY --kvguard-plan plan.json

At the start of the run the plan is read from ``--kvguard-plan`` or, when that file does not exist
yet, made against ``--host`` (load tenants, the model's limit, calibrated sizes; the gateway's
admin token and canary key from ``KVGUARD_ADMIN_TOKEN``/``KVGUARD_CANARY_KEY``, as for
``kvguard load``) and written there (readable by its owner only: it holds tenant keys), so the
next run reuses it; ``kvguard load --write-plan FILE`` writes one too. Each run draws its own
marker seed and logs it; ``--kvguard-marker-seed N`` sends a logged run's markers again (with the
same plan), and only then: with several Locust workers, one seed would send every marker
once per worker. Add ``kvguard/load/shape.py``
to ``-f`` for the long-context ramp. Locust's ``--csv``/``--csv-full-history``/``--html`` give its
tables; each failed request's error text is the checks' reasons.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import requests
from locust import User, constant, events, task
from locust.exception import StopUser

from canary.config import CanarySettings
from canary.markers import Marker, MarkerCodec, MarkerKeyring
from canary.probes import filler_text, reference_chat
from kvguard.load.content import (
    Expected,
    FailureKind,
    SseLines,
    StreamedAnswer,
    Verdict,
    check_answer,
    error_code,
    read_sse_line,
)
from kvguard.load.plan import (
    SIZE_NAMES,
    LoadPlan,
    LoadTenant,
    SizeClass,
    draw_marker_seed,
    marker_nonce,
)
from kvguard.load.report import Sample
from kvguard.load.stage import CURRENT_STAGE


class CheckFailed(Exception):
    """A response that broke an expectation; the message is the checks' reasons (no content)."""


@dataclass
class Budget:
    """The run's request bound, shared by every user of the process (gevent: no real threads)."""

    limit: int | None
    issued: int = 0
    in_flight: int = 0

    def take(self) -> int | None:
        if self.limit is not None and self.issued >= self.limit:
            return None
        self.issued += 1
        self.in_flight += 1
        return self.issued - 1

    def release(self) -> None:
        self.in_flight -= 1

    @property
    def exhausted(self) -> bool:
        return self.limit is not None and self.issued >= self.limit and self.in_flight == 0


@dataclass
class LoadContext:
    plan: LoadPlan
    codec: MarkerCodec
    budget: Budget
    marker_seed: int
    samples: list[Sample] = field(default_factory=list)

    @classmethod
    def from_plan(
        cls, plan: LoadPlan, *, keyring: MarkerKeyring | None = None, marker_seed: int | None = None
    ) -> LoadContext:
        """``keyring``: the one the plan was calibrated with (default: this environment's);
        ``marker_seed``: default the plan's, or a fresh one."""
        codec = MarkerCodec(keyring or CanarySettings().keyring())
        if marker_seed is None:
            marker_seed = draw_marker_seed() if plan.marker_seed is None else plan.marker_seed
        return cls(plan, codec, Budget(plan.max_requests), marker_seed)

    def marker(self, slot: int, index: int, size: SizeClass) -> Marker:
        """The marker the run's ``slot``-th request carries (``marker_owner``'s)."""
        owner = self.marker_owner(index, size)
        return self.codec.issue(owner.id, nonce=marker_nonce(self.marker_seed, slot))

    def marker_owner(self, index: int, size: SizeClass) -> LoadTenant:
        """Whose marker the request carries: its own tenant's, or the next one's (foreign)."""
        tenants = self.plan.tenants
        return tenants[(index + 1) % len(tenants)] if size.name == "foreign" else tenants[index]

    def pick(self, slot: int) -> tuple[int, LoadTenant, SizeClass]:
        """The tenant and size of the run's ``slot``-th request (among the stage's sizes)."""
        sizes, tenants = self.plan.sizes, self.plan.tenants
        if CURRENT_STAGE.sizes is not None:
            sizes = tuple(s for s in sizes if s.name in CURRENT_STAGE.sizes) or sizes
        index = (slot // len(sizes)) % len(tenants)
        return index, tenants[index], sizes[slot % len(sizes)]


class ChatUser(User):
    """A closed-loop client: one streamed chat after another, no think time."""

    wait_time = constant(0)
    ctx: ClassVar[LoadContext | None] = None

    def on_start(self) -> None:
        self.session = requests.Session()

    def on_stop(self) -> None:
        self.session.close()

    @task
    def chat(self) -> None:
        ctx = self.ctx
        if ctx is None:
            raise StopUser()
        slot = ctx.budget.take()
        if slot is None:
            raise StopUser()
        try:
            index, tenant, size = ctx.pick(slot)
            sample, error = self._one(ctx, ctx.marker(slot, index, size), index, tenant, size)
        finally:
            ctx.budget.release()
        ctx.samples.append(sample)
        self.environment.events.request.fire(
            request_type="POST",
            name=f"chat {size.name}",
            response_time=sample.e2e_ms,
            response_length=0,
            exception=error,
            context={"tenant": tenant.name, "size": size.name},
        )

    def _one(
        self, ctx: LoadContext, marker: Marker, index: int, tenant: LoadTenant, size: SizeClass
    ) -> tuple[Sample, Exception | None]:
        plan = ctx.plan
        expected = Expected(
            status=size.expected_status,
            code=size.expected_code,
            marker=marker.text,
            max_tokens=size.max_tokens,
            prompt_tokens=size.prompt_tokens,
            prompt_slack=plan.prompt_slack,
            byte_tokens=plan.byte_tokens,
        )
        body = {
            "model": plan.model,
            "messages": reference_chat(marker, filler=filler_text(size.filler_chars)),
            "max_tokens": size.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        timing = _Timing(started)
        try:
            answer = self._stream(plan, tenant, body, timing)
        except Exception as exc:
            # Transport errors and anything unforeseen become a counted failure: a request that
            # vanished from the samples would make a broken run look clean.
            e2e = (time.perf_counter() - started) * 1000
            what = "transport" if isinstance(exc, requests.RequestException) else "client"
            reason = f"{FailureKind.STATUS.value}: {what} error {exc.__class__.__name__}"
            sample = Sample(size.name, index, 0, None, e2e, failure_kinds=("status",))
            return replace(sample, reasons=(reason,)), CheckFailed(reason)
        e2e = (time.perf_counter() - started) * 1000
        verdict = check_answer(expected, answer)
        return _sample(size, index, answer, timing, e2e, verdict), _error(verdict)

    def _stream(
        self, plan: LoadPlan, tenant: LoadTenant, body: dict[str, Any], timing: _Timing
    ) -> StreamedAnswer:
        headers = {"Authorization": f"Bearer {tenant.key}"}
        url = plan.gateway + "/v1/chat/completions"
        timeout = (10.0, plan.request_timeout_s)
        with self.session.post(url, json=body, headers=headers, stream=True, timeout=timeout) as r:
            answer = StreamedAnswer(status=r.status_code)
            if r.status_code != 200:
                answer.code = error_code(r.content)
                return answer
            lines = SseLines()
            for chunk in r.iter_content(chunk_size=None):
                for line in lines.feed(chunk):
                    if read_sse_line(answer, line):
                        timing.chunk(time.perf_counter())
        return answer


@dataclass
class _Timing:
    started: float
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)

    def chunk(self, now: float) -> None:
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.append((now - self.last) * 1000)
        self.last = now


def _sample(
    size: SizeClass,
    index: int,
    answer: StreamedAnswer,
    timing: _Timing,
    e2e_ms: float,
    verdict: Verdict,
) -> Sample:
    usage = answer.usage or {}
    ttft = None if timing.first is None else (timing.first - timing.started) * 1000
    return Sample(
        size=size.name,
        tenant=index,
        status=answer.status,
        code=answer.code,
        e2e_ms=e2e_ms,
        ttft_ms=ttft,
        itl_ms=tuple(timing.gaps),
        prompt_tokens=_int(usage.get("prompt_tokens")),
        completion_tokens=_int(usage.get("completion_tokens")),
        failure_kinds=tuple(sorted(kind.value for kind in verdict.kinds)),
        reasons=tuple(f"{kind.value}: {reason}" for kind, reason in verdict.failures),
    )


def _error(verdict: Verdict) -> Exception | None:
    return None if verdict.ok else CheckFailed(verdict.reason())


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) else None


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument(
        "--kvguard-plan",
        default="",
        help="plan file: read it, or make it against --host and write it there",
    )
    parser.add_argument("--kvguard-tenants", type=int, default=2, help="synthetic tenants")
    parser.add_argument("--kvguard-model", default="", help="default: the first model served")
    parser.add_argument(
        "--kvguard-sizes", default=",".join(SIZE_NAMES), help="comma-separated size classes"
    )
    parser.add_argument(
        "--kvguard-stage-seconds", type=float, default=20.0, help="kvguard/load/shape.py stages"
    )
    parser.add_argument(
        "--kvguard-marker-seed",
        type=int,
        default=None,
        help="send the markers of the run that logged this seed (default: a fresh seed)",
    )


@events.test_start.add_listener
def _load_plan(environment: Any, **_: Any) -> None:
    # `kvguard load`'s worker sets ChatUser.ctx itself; a `locust -f` run gets it here.
    options = environment.parsed_options
    if ChatUser.ctx is not None or options is None:
        return
    try:
        plan = _standalone_plan(options, environment.host)
    except Exception as exc:
        logging.getLogger("kvguard.load").error("kvguard load plan: %s", exc)
        environment.process_exit_code = 2
        if environment.runner is not None:
            environment.runner.quit()
        return
    ChatUser.ctx = LoadContext.from_plan(plan, marker_seed=options.kvguard_marker_seed)
    logging.getLogger("kvguard.load").info("kvguard load: marker seed %d", ChatUser.ctx.marker_seed)


def _standalone_plan(options: Any, host: str | None) -> LoadPlan:
    path = Path(options.kvguard_plan) if options.kvguard_plan else None
    if path is not None and path.exists():
        return LoadPlan.load(path)
    if not host:
        raise ValueError("pass --host (the gateway) or an existing --kvguard-plan")
    from kvguard.load.runner import PLAN_FILE_KEY_LIFETIME_S, LoadOptions, prepare_plan

    settings = CanarySettings()
    load_options = LoadOptions(
        gateway=host.rstrip("/"),
        out_dir=Path("."),
        tenants=options.kvguard_tenants,
        model=options.kvguard_model or None,
        sizes=tuple(s.strip() for s in options.kvguard_sizes.split(",") if s.strip()),
        key_lifetime_s=PLAN_FILE_KEY_LIFETIME_S,
    )
    codec = MarkerCodec(settings.keyring())
    plan = prepare_plan(load_options, codec=codec, admin_token=settings.admin_secret())
    if path is not None:
        plan.save(path)
    return plan
