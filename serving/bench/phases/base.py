"""What a bench phase is, and the options every run shares.

A phase owns everything about one kind of measurement: its command-line options (each one naming
the ``Settings`` field it fills), how many requests it plans, how it sends them, what the report
keeps of it, and what the command, the page and the plots say about it. The runner, the plan, the
summary, the page and the CLI walk :data:`flashnext.serving.bench.phases.PHASES` instead of naming
phases, so that a phase is added in one module and cannot be half wired.

The option kinds here are plain data: the library does not import click, and ``tools/bench.py``
turns each kind into its click type. The command makes its options from the phases before it knows
whether the bench extra (httpx, jsonschema, matplotlib) is installed, and says what to install when
it is not; so the phases' modules import the rest of the bench library where they measure and draw,
not when they are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the report's types sit below the phases; the runner, above them, is not imported
    from flashnext.serving.bench.report import BenchReport, EndpointReport, Settings, Summary


@dataclass(frozen=True)
class Ints:
    """A comma-separated list of whole numbers in [low, high] (``8k`` is 8192)."""

    low: int
    high: int | None = None


@dataclass(frozen=True)
class Floats:
    """A comma-separated list of finite numbers in [low, high]."""

    low: float
    high: float | None = None


@dataclass(frozen=True)
class Int:
    """One whole number in [low, high]."""

    low: int | None = None
    high: int | None = None


@dataclass(frozen=True)
class Seconds:
    """A finite number of seconds above zero."""


@dataclass(frozen=True)
class Size:
    """``WIDTHxHEIGHT`` in pixels, each in [low, high]; the setting is ``[width, height]``."""

    low: int
    high: int


@dataclass(frozen=True)
class Choice:
    choices: tuple[str, ...]


@dataclass(frozen=True)
class Text:
    """Text the command reads itself (``--phases``, ``--extra-body``): its errors are its own."""


@dataclass(frozen=True)
class Option:
    """One command-line option: ``flag`` fills the ``Settings`` field ``setting``."""

    flag: str
    setting: str
    kind: Ints | Floats | Int | Seconds | Size | Choice | Text
    default: Any
    help: str


class Phase(Protocol):
    """One phase of a run. ``report_field`` is the ``EndpointReport`` field its results go in
    (``Endpoint.results`` holds them during the run), or None for a phase that keeps none."""

    name: str
    help: str                       # its lines of ``flashnext bench --help``
    by_default: bool                # in --phases' default; False for the workloads that take hours at their defaults
    options: tuple[Option, ...]
    report_field: str | None
    server_text: frozenset[str]     # its result fields that keep a server's text: scrubbed of the URL's secrets

    def empty_result(self) -> Any: ...

    def planned_requests(self, settings: Settings) -> int:
        """The requests it sends to each endpoint."""

    async def run(self, bench) -> None:
        """Send its requests through ``bench``, the runner's
        :class:`~flashnext.serving.bench.runner.Bench` (``bench.body``, ``bench.send``,
        ``bench.endpoints``, ``bench.settings``), and keep its results in each endpoint's
        ``results[report_field]``."""

    def problems(self, e: EndpointReport) -> list[str]:
        """What went wrong in its answers, one line each (failed requests are counted apart)."""

    def summary(self, e: EndpointReport) -> dict:
        """Its entries of ``--json``'s summary."""

    def summary_lines(self, e: EndpointReport) -> list[str]: ...

    def html(self, e: EndpointReport) -> list[str]:
        """Its part of report.html for one endpoint."""

    def plots(self, report: BenchReport) -> dict[str, bytes | None]:
        """Its pictures by file name, None where the report has no data for one."""


class PhaseDefaults:
    """What a phase that keeps, says or draws nothing of its own inherits."""

    report_field: str | None = None
    by_default: bool = True
    options: tuple[Option, ...] = ()
    server_text: frozenset[str] = frozenset()

    def empty_result(self) -> Any:
        return None

    def problems(self, e: EndpointReport) -> list[str]:
        return []

    def summary(self, e: EndpointReport) -> dict:
        return {}

    def summary_lines(self, e: EndpointReport) -> list[str]:
        return []

    def html(self, e: EndpointReport) -> list[str]:
        return []

    def plots(self, report: BenchReport) -> dict[str, bytes | None]:
        return {}


# The rounds are latency's and decode's together: one --warmup and one --repeats for both.
ROUND_OPTIONS = (
    Option("--warmup", "warmup", Int(0), 1, "Warm-up rounds per point."),
    Option("--repeats", "repeats", Int(1), 3, "Measured rounds per point."),
)
RUN_OPTIONS = (
    Option("--seed", "seed", Int(), 0, "Sampling seed and prompt seed."),
    Option("--request-timeout", "request_timeout_s", Seconds(), 1800.0, "Seconds a request may take in all."),
    Option("--stall-timeout", "stall_timeout_s", Seconds(), 120.0,
           "Seconds a stream may stay silent before it counts as stalled."),
    Option("--extra-body", "extra_body", Text(), "{}",
           'JSON merged into every request, e.g. \'{"chat_template_kwargs": {"enable_thinking": false}}\'.'),
    Option("--metrics-interval", "metrics_interval_s", Seconds(), 1.0,
           "Seconds between scrapes of the server's /metrics during a phase (its start and end are scraped too)."),
)


def summary_of(values: list[float]) -> Summary | None:
    from flashnext.serving.bench import metrics
    from flashnext.serving.bench.report import Summary

    s = metrics.summary(values)
    return Summary(**s) if s else None
