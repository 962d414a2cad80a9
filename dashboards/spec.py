"""What the dashboards and alerts show, as plain data: panels, queries and alert rules.

Every metric name comes from the one module that defines it (``backend.metrics``,
``gateway.metrics``, ``canary.metrics``), so a renamed metric breaks the build here, not a panel
in production. Engine series carry no ``engine``/``role`` labels of their own: Prometheus adds
them per scrape target (see ``dashboards.build.scrape_config``), using the engine name the gateway
routes by, so engine-side and gateway-side series join on ``engine``.

Queries use Grafana's ``$__rate_interval`` and the ``$tenant``/``$engine`` variables; the
Prometheus test substitutes them before evaluating each query.
"""

from __future__ import annotations

from dataclasses import dataclass

RI = "$__rate_interval"
TENANT = 'tenant=~"$tenant"'
ENGINE = 'engine=~"$engine"'
CANARY_COVERAGE_TARGET = 0.01  # alert when a tenant's marked share stays below 1 %


def total(name: str) -> str:
    """prometheus_client exposes a counter ``x`` as ``x_total`` (engine names omit the suffix)."""
    return name if name.endswith("_total") else name + "_total"


def bucket(name: str) -> str:
    return name + "_bucket"


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # timeseries | stat | table
    unit: str = "short"
    description: str = ""


@dataclass(frozen=True, slots=True)
class Dashboard:
    uid: str
    title: str
    panels: tuple[Panel, ...]
    variables: tuple[str, ...] = ("engine",)  # tenant | engine


@dataclass(frozen=True, slots=True)
class AlertRule:
    name: str
    expr: str
    severity: str  # critical | warning
    summary: str
    first_response: str
    for_: str = "0m"


def _q(expr: str, legend: str = "", instant: bool = False) -> Query:
    return Query(" ".join(expr.split()), legend, instant)


def share(metric: str, by: str, part: str, matcher: str = "", window: str = RI) -> str:
    """The share of ``metric``'s rate matching ``part``, by ``by``: 0 (not no data) when no
    series matches ``part``, so a tenant with no marked request shows 0 % and can alert."""
    sel = f"{{{matcher}}}" if matcher else ""
    part_sel = f"{{{part}, {matcher}}}" if matcher else f"{{{part}}}"
    whole = f"sum by ({by}) (rate({metric}{sel}[{window}]))"
    return f"(sum by ({by}) (rate({metric}{part_sel}[{window}])) or 0 * {whole}) / {whole}"


def events_in(metric: str, window: str, matcher: str = "") -> str:
    """Per series, the events a counter counted in the last ``window``, first samples included.

    ``increase`` cannot see a series' first sample: a counter created on its first event (a
    finding, a cut: prometheus_client makes a labelled series only when it is first used) appears
    at 1 and ``increase`` stays 0, so the first finding would never alert. A series older than
    ``window`` contributes its increase; a newer one (present now, absent ``window`` ago) its
    whole value. (A Prometheus with less history than ``window``, e.g. a fresh one, sees every
    series as new: a counter above 0 counts once more until ``window`` has passed.)
    """
    sel = f"{metric}{{{matcher}}}" if matcher else metric
    old, new = f"{sel} offset {window}", f"{sel} unless {sel} offset {window}"
    return f"(increase({sel}[{window}]) and {old}) or ({new})"


def events(metric: str, by: str, window: str, matcher: str = "") -> str:
    """Alert condition: ``metric`` counted an event in the last ``window`` (see ``events_in``)."""
    return f"sum by ({by}) ({events_in(metric, window, matcher)}) > 0"


def event_count(metric: str, window: str, matcher: str = "") -> str:
    """How many events ``metric`` counted in the last ``window``: 0, not no data, when none."""
    return f"sum({events_in(metric, window, matcher)}) or vector(0)"


def _quantiles(metric: str, by: str, matcher: str = "", legend: str = "") -> tuple[Query, ...]:
    """p50/p95/p99 of a histogram by ``by``; ``legend`` prefixes each series' name."""
    sel = f"{{{matcher}}}" if matcher else ""
    prefix = f"{legend} " if legend else ""
    return tuple(
        _q(
            f"histogram_quantile({q}, sum by (le, {by}) (rate({bucket(metric)}{sel}[{RI}])))",
            f"{prefix}p{int(q * 100)} {{{{{by.split(',')[0].strip()}}}}}",
        )
        for q in (0.5, 0.95, 0.99)
    )
