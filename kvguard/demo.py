"""`kvguard demo`: two tenants, a passing probe, a refusal, then the incident replayed and caught.

Lifecycle: lay out and start the drill stack (``kvguard.drillstack``: the incident's ``drill``
engine and a ``guarded`` one behind the gateway; a fresh SQLite database and the role logs in a
temp dir; everything stopped at exit), then narrate, in the order the story is told:

1. the stack, and what is misconfigured on purpose;
2. two tenants chat normally on ``guarded``: A, whose every request carries a canary marker
   (stripped from A's answer), and B;
3. a canary echo probe passes on ``guarded`` (and is reported to the gateway, like
   ``kvguard canary probe``);
4. the capacity check: B's request that fits the advertised window but not the real pool gets
   400 ``context_length_exceeded`` on ``guarded``, before any page is reserved;
5. the incident on ``drill`` (the misconfigured engine with the incident's fault drill): A's
   chat, then the same request from B. The legacy handoff lets decode read A's stale pages, the
   model copies A's marker, and the firewall cuts B's stream before the marker reaches B, stores
   a cross-tenant finding naming A's request and quarantines the engine;
6. a summary table and where to look in Grafana.

Exit status 0 only when every step held. The narrative shows ids, codes and sizes: the marker
never leaves the gateway, and no prompt or answer text is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from kvguard.drillstack import (
    A_MAX,
    A_TOKENS,
    B_MAX,
    B_TOKENS,
    CUT_CODE,
    DECODE_FAULTS,
    DECODE_POOL,
    DRILL,
    DRILL_MODEL,
    GUARDED,
    GUARDED_MODEL,
    PREFILL_FAULTS,
    PREFILL_POOL,
    REFUSED_CODE,
    WINDOW,
    Act,
    DrillStack,
    Exchange,
    StackFailed,
    a_messages,
    chat_of,
    create_tenant,
    drill_stack,
    finding_for,
    play,
    quarantine_of,
    running,
    send,
)

if TYPE_CHECKING:
    import httpx


# -- the story -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Probe:
    passed: bool
    observed: str


@dataclass(frozen=True, slots=True)
class Story:
    """What happened at each step, in the order told."""

    a_id: str
    chats: Act  # step 2: A's and B's ordinary chats on guarded
    probe: Probe  # step 3
    refusal: Exchange  # step 4: B's over-long request on guarded
    incident: Act  # step 5: A's chat, then the same over-long request from B, on drill
    finding: dict[str, Any] | None
    quarantine: str | None

    def served(self) -> bool:
        """Both tenants chatted normally, A's own marker stripped from what A received."""
        a, b = self.chats.a, self.chats.b
        ok_a = (a.status, a.codes, a.marker_seen) == (200, (), False)
        return ok_a and (b.status, b.codes) == (200, ())

    def refused(self) -> bool:
        """The probe passed, and B's request that fits the window but not the pool was refused."""
        r = self.refusal
        return self.probe.passed and (r.status, r.codes) == (400, (REFUSED_CODE,))

    def leak_caught(self) -> bool:
        """B's stream was cut before A's marker reached B, and the evidence names A's request."""
        f, a, b = self.finding, self.incident.a, self.incident.b
        return (
            a.status == 200
            and (b.status, b.codes) == (200, (CUT_CODE,))
            and not b.marker_seen
            and f is not None
            and (f["kind"], f["severity"]) == ("cross_tenant", "critical")
            and (f["victim_tenant_id"], f["victim_request_id"]) == (self.a_id, a.request_id)
            and self.quarantine is not None
        )

    def held(self) -> bool:
        return self.served() and self.refused() and self.leak_caught()


class Narrator:
    def __init__(self, out: TextIO, steps: int) -> None:
        self.out, self.steps, self.step = out, steps, 0

    def head(self, text: str) -> None:
        self.step += 1
        self.say(f"\n[{self.step}/{self.steps}] {text}", indent=0)

    def say(self, text: str, indent: int = 6) -> None:
        print(" " * indent + text, file=self.out, flush=True)


def _short(request_id: str | None) -> str:
    return (request_id or "?")[:12] + "..."


def echo_probe(stack: DrillStack, model: str) -> Probe:
    """One echo probe through the gateway, reported to it (what ``kvguard canary probe`` does),
    with the stack's canary key and admin token."""
    import asyncio
    import uuid

    import httpx
    from pydantic import SecretStr

    from canary.config import CanarySettings
    from canary.findings import ProbeKind
    from canary.markers import MarkerCodec
    from canary.probes import GatewayClient, ProbeRunner

    settings = CanarySettings(
        canary_key=SecretStr(stack.canary_key), admin_token=SecretStr(stack.admin_token)
    )

    async def probe() -> Probe:
        async with httpx.AsyncClient(base_url=stack.gateway, timeout=120) as http:
            client = GatewayClient(http, admin_token=settings.admin_secret())
            runner = ProbeRunner(client, MarkerCodec(settings.keyring()), model=model)
            try:
                [result] = await runner.run([ProbeKind.ECHO])
                await client.report(uuid.uuid4().hex, [result])
            finally:
                await runner.close()  # the probe tenants' keys are revoked, as the CLI does
            return Probe(result.passed, result.observed)

    return asyncio.run(probe())


def _line(n: Narrator, who: str, what: str, outcome: str) -> None:
    n.say(f"{who:<9} {what:<30} -> {outcome}")


CHAT_TOKENS, CHAT_MAX = 48, 8  # B's ordinary chat


def _chats(n: Narrator, client: httpx.Client, keys: tuple[str, str]) -> Act:
    n.head(f"Two tenants chat on {GUARDED!r} (the gateway enforces its real pool)")
    a = send(client, keys[0], GUARDED_MODEL, a_messages(), max_tokens=A_MAX)
    b = send(client, keys[1], GUARDED_MODEL, chat_of(CHAT_TOKENS), max_tokens=CHAT_MAX)
    marker = "own marker stripped" if not a.marker_seen else "MARKER DELIVERED"
    _line(n, "tenant-a", f"{A_TOKENS}-token chat, marker inside", f"{a.outcome()}, {marker}")
    _line(n, "tenant-b", f"{CHAT_TOKENS}-token chat", b.outcome())
    return Act(GUARDED, a, b)


def _probe(n: Narrator, stack: DrillStack) -> Probe:
    n.head(f"A canary probe on {GUARDED!r}: a synthetic tenant asks for its own marker back")
    probe = echo_probe(stack, GUARDED_MODEL)
    verdict = "pass" if probe.passed else "FAIL"
    _line(n, "probe", f"canary echo probe on {GUARDED!r}", f"{verdict} ({probe.observed})")
    return probe


def _over_long(client: httpx.Client, key: str, model: str) -> Exchange:
    return send(client, key, model, chat_of(B_TOKENS), max_tokens=B_MAX, stream=True)


def _capacity_check(n: Narrator, client: httpx.Client, key_b: str) -> Exchange:
    n.head("The capacity check: a request that fits the window but not the pool")
    refusal = _over_long(client, key_b, GUARDED_MODEL)
    _line(n, "tenant-b", f"{B_TOKENS} + {B_MAX} tokens, streamed", refusal.outcome())
    n.say(
        f"          fits the advertised {WINDOW}-token window, not the {PREFILL_POOL}-token pool:"
    )
    n.say("          refused at the gateway before any page is reserved")
    return refusal


def _incident(n: Narrator, client: httpx.Client, keys: tuple[str, str]) -> Act:
    n.head(
        f"The incident's deployment (engine {DRILL!r}, fault drill on; only the firewall stands)"
    )
    act = play(client, DRILL, DRILL_MODEL, *keys)
    outcome = f"{act.a.outcome()}  (request {_short(act.a.request_id)})"
    _line(n, "tenant-a", f"{A_TOKENS}-token chat, marker inside", outcome)
    _line(n, "tenant-b", "the same over-long request", act.b.outcome())
    n.say(f"          prefill's {PREFILL_POOL}-token pool rejects it, the legacy handoff says")
    n.say("          'done', decode reads tenant-a's stale pages and the model copies what it")
    n.say("          finds there: the leak is reproduced")
    chars = f"{act.b.text_chars} character{'s' if act.b.text_chars != 1 else ''}"
    marker = "A WHOLE MARKER" if act.b.marker_seen else "no marker"
    n.say(f"          tenant-b received {chars} before the firewall cut the stream, {marker}")
    return act


def _evidence(
    n: Narrator, client: httpx.Client, admin: dict[str, str], act: Act, a_id: str
) -> tuple[Any, str | None]:
    finding = finding_for(client, admin, act.b.request_id)
    if finding is None:
        n.say("finding   none stored for tenant-b's request")
    else:
        victim = "tenant-a" if finding["victim_tenant_id"] == a_id else "another tenant"
        n.say(f"finding   #{finding['id']} {finding['kind']} / {finding['severity']} on engine")
        n.say(f"          {finding['engine']!r}, action {finding['action']}: {victim}'s request")
        n.say(f"          {_short(finding['victim_request_id'])} was seen in tenant-b's answer")
    quarantine = quarantine_of(client, admin, DRILL)
    state = "quarantined: no tenant is routed to it" if quarantine else "NOT quarantined"
    n.say(f"engine    {DRILL!r} {state}")
    return finding, quarantine


def summary(story: Story) -> str:
    probe = "echo pass" if story.probe.passed else "echo FAIL"
    rows = [
        ("step", "engine", "tenant-a", "tenant-b", "held"),
        (
            "2 chats",
            GUARDED,
            story.chats.a.outcome(),
            story.chats.b.outcome(),
            "served" if story.served() else "NO",
        ),
        ("3 probe", GUARDED, probe, "-", "passed" if story.probe.passed else "NO"),
        (
            "4 capacity check",
            GUARDED,
            "-",
            story.refusal.outcome(),
            "refused" if story.refused() else "NO",
        ),
        (
            "5 incident",
            DRILL,
            story.incident.a.outcome(),
            story.incident.b.outcome(),
            "leak caught" if story.leak_caught() else "NO",
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _panel(dashboard: Any, prefix: str) -> str:
    """A panel's title by its start (a renamed panel fails the demo's test, not silently)."""
    return next(p.title for p in dashboard.panels if p.title.startswith(prefix))


def grafana_pointers() -> list[str]:
    from dashboards.catalog import CAPACITY, ISOLATION, TRAFFIC

    return [
        "Where to look in Grafana (the compose stack provisions these dashboards):",
        f"  {TRAFFIC.title} (tenant variable): {_panel(TRAFFIC, 'Requests by outcome')}",
        f"  {ISOLATION.title}",
        f"    {_panel(ISOLATION, 'Probe pass rate')}, {_panel(ISOLATION, 'Critical findings')},",
        f"    {_panel(ISOLATION, 'Streams cut')}, {_panel(ISOLATION, 'Quarantined engines')};",
        "    alert KvguardCrossTenantFinding (critical)",
        f"  {CAPACITY.title}",
        f"    {_panel(CAPACITY, 'Window vs pool')}, {_panel(CAPACITY, 'Capacity drift')},",
        f"    {_panel(CAPACITY, 'Fault drills')},",
        f"    {_panel(CAPACITY, 'Rejections by reason (gateway)')}",
    ]


def tell(stack: DrillStack, n: Narrator) -> Story:
    """Every step against a running drill stack, in order; prints the narrative, returns what
    happened."""
    import httpx

    with httpx.Client(base_url=stack.gateway, timeout=120) as client:
        a_id, key_a = create_tenant(client, stack.admin(), "tenant-a", sample_rate=1.0)
        _, key_b = create_tenant(client, stack.admin(), "tenant-b")
        keys = (key_a, key_b)
        chats = _chats(n, client, keys)
        n.say("          tenant-a's marker is an HMAC-signed code naming tenant-a and its")
        n.say("          request; the gateway puts it in the prompt and strips it from the answer")
        probe = _probe(n, stack)
        refusal = _capacity_check(n, client, key_b)
        incident = _incident(n, client, keys)
        finding, quarantine = _evidence(n, client, stack.admin(), incident, a_id)
    return Story(a_id, chats, probe, refusal, incident, finding, quarantine)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="replay the incident's leak on local processes and watch kvguard catch it",
        description="Start a drill stack (the incident's misconfigured engine and a guarded one) "
        "on 127.0.0.1: two tenants chat, a canary probe passes, the capacity check refuses a "
        "request that fits the window but not the pool, then the same request replays the leak "
        "on the misconfigured engine. Exit 0 when every step held and the leak was caught.",
    )
    parser.add_argument("--model", type=Path, default=None, help="default: the bundled model")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="database and role logs (default: a temp dir)"
    )
    parser.set_defaults(handler=run)


def _intro(n: Narrator, stack: DrillStack, work_dir: Path) -> None:
    n.say("kvguard demo: the 2026 cross-tenant KV leak, replayed on this machine", indent=0)
    n.head("Starting the drill stack: 4 local processes, the bundled model on CPU")
    n.say(f"drill     prefill: real pool {PREFILL_POOL} tokens, advertised window {WINDOW};")
    n.say(f"          drill {', '.join(PREFILL_FAULTS)}")
    n.say(f"          decode: pool {DECODE_POOL}; drills {', '.join(DECODE_FAULTS[:2])},")
    n.say(f"          {', '.join(DECODE_FAULTS[2:])}")
    n.say("          the gateway sees an opaque engine with a declared window and trusts")
    n.say("          its handoff; only the canary firewall stands")
    n.say(f"guarded   real pool {PREFILL_POOL}, window {WINDOW}, no drill: the gateway reads the")
    n.say(f"          pool and enforces {PREFILL_POOL}")
    n.say(f"gateway   {stack.gateway}  (role logs in {work_dir})")


def run_demo(work_dir: Path, out: TextIO, *, model: Path | None = None) -> int:
    import httpx

    n = Narrator(out, steps=6)
    env = {**os.environ, "KVGUARD_MODE": "development"}
    (work_dir / "data").mkdir(parents=True, exist_ok=True)
    stack = drill_stack(work_dir / "data", env, model=model)
    _intro(n, stack, work_dir)
    started = time.monotonic()
    try:
        with running(stack, work_dir):
            n.say(f"all roles ready in {time.monotonic() - started:.0f} s")
            story = tell(stack, n)
    except (StackFailed, httpx.HTTPError) as exc:
        print(f"kvguard demo: {exc}", file=out, flush=True)
        return 1
    n.head("Summary")
    print(summary(story) + "\n", file=out)
    print("\n".join(grafana_pointers()), file=out)
    held = story.held()
    verdict = (
        "the story held: tenants served, probe passed, over-long request refused, leak caught"
        if held
        else "the story did NOT hold (see above)"
    )
    print(f"\nkvguard demo: {verdict}", file=out, flush=True)
    return 0 if held else 1


def run(args: argparse.Namespace) -> int:
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        return run_demo(args.work_dir, sys.stdout, model=args.model)
    with tempfile.TemporaryDirectory(prefix="kvguard-demo-") as tmp:
        return run_demo(Path(tmp), sys.stdout, model=args.model)
