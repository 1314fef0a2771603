"""``flashnext bench URL``: measure a served endpoint, or A/B two, and write a report with plots.

The options that fill the run's settings, and the phase list of ``--help``, are made from the
phase registry (``flashnext.serving.bench.phases``): each is spelled once, where its phase is.
"""

from __future__ import annotations

import math
from pathlib import Path

import click

from flashnext.serving.bench.phases import PHASES, setting_options
from flashnext.serving.bench.phases.base import Choice, Floats, Int, Ints, Option, Seconds, Size, Text
from flashnext.tools._common import emit_json, json_option, user_errors


def _items(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


class _ListOf(click.ParamType):
    """A comma-separated list: ``4096,32768`` (``k`` suffix for thousands: ``8k``, ``262144`` as is)."""

    def __init__(self, kind: type, low: float, high: float | None = None):
        self.kind, self.low, self.high = kind, low, high
        self.name = f"{kind.__name__}[,{kind.__name__}...]"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            out = [self.kind(float(x[:-1]) * 1024) if x.lower().endswith("k") and self.kind is int else self.kind(x)
                   for x in _items(value)]
        except (ValueError, OverflowError):
            self.fail(f"{value!r} is not a comma-separated list of {self.kind.__name__}s", param, ctx)
        if not all(math.isfinite(x) for x in out):  # report.json holds no NaN or Infinity
            self.fail(f"{value!r}: give finite numbers", param, ctx)
        if not out:
            self.fail("give at least one value", param, ctx)
        bad = [x for x in out if x < self.low or (self.high is not None and x > self.high)]
        if bad:
            self.fail(f"{bad[0]} is out of range [{self.low}, {self.high if self.high is not None else '∞'}]", param, ctx)
        return out


class _Seconds(click.FloatRange):
    """Seconds, more than zero and finite (report.json holds no Infinity, and no NaN)."""

    def __init__(self):
        super().__init__(min=0, min_open=True)

    def convert(self, value, param, ctx):
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return seconds


class _Size(click.ParamType):
    """``WIDTHxHEIGHT`` in pixels: ``2048x1024``."""

    name = "WIDTHxHEIGHT"

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        parts = str(value).lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            self.fail(f"{value!r} is not WIDTHxHEIGHT in pixels (e.g. 2048x1024)", param, ctx)
        size = [int(p) for p in parts]
        if not all(self.low <= x <= self.high for x in size):
            self.fail(f"{value!r}: width and height must lie in [{self.low}, {self.high}]", param, ctx)
        return size


def _click_type(kind):
    if isinstance(kind, Ints):
        return _ListOf(int, kind.low, kind.high)
    if isinstance(kind, Floats):
        return _ListOf(float, kind.low, kind.high)
    if isinstance(kind, Int):
        return int if kind.low is None and kind.high is None else click.IntRange(kind.low, kind.high)
    if isinstance(kind, Seconds):
        return _Seconds()
    if isinstance(kind, Size):
        return _Size(kind.low, kind.high)
    if isinstance(kind, Choice):
        return click.Choice(list(kind.choices))
    if isinstance(kind, Text):
        return str
    raise TypeError(f"no click type for {kind!r}")


def _click_option(o: Option):
    return click.option(o.flag, o.setting, type=_click_type(o.kind), default=o.default, show_default=True,
                        help=o.help)


def _phases(value: str) -> list[str]:
    got = _items(value)
    unknown = [p for p in got if p not in PHASES]
    if unknown or not got:
        raise click.BadParameter(f"choose from {', '.join(PHASES)} (comma-separated)", param_hint="--phases")
    return [p for p in PHASES if p in got]


def _phase_lines() -> str:
    lines = []
    for p in PHASES.values():
        first, *more = p.help.splitlines()
        lines.append(f"  {p.name:<11} {first}")
        lines += [f"{'':14}{line}" for line in more]
    return "\n".join(lines)


_HELP = """Measure the OpenAI-compatible server at URL as seed 000 does, and write OUT/report.json,
PNG plots and one self-contained OUT/report.html.

\b
Phases (--phases):
{phases}
A/B: --against URL2 runs both side by side, round by round; --baseline compares with a saved run
(for a patch switch: run with it on, restart with it off, run with --baseline). Both give
token agreement and, where the servers return logprobs, mean KL divergence.

\b
Example (the seed's figures on the 3x3090 rig):
  flashnext bench http://127.0.0.1:8000 --out bench/run1 --decode-concurrency 1,2,4 \\
      --needle-tokens 262144 --needle-depths 0.5 --needle-concurrency 4
"""


def _run(url, against, baseline, allow_different_settings, model, against_model, out, force, fail_on_errors,
         progress, as_json, **given):
    import importlib.util

    from flashnext.errors import FlashnextError, UsageError

    # Checked before a run, not when the plots are drawn after an hour of measuring.
    missing = [m for m in ("httpx", "matplotlib", "jsonschema") if importlib.util.find_spec(m) is None]
    if missing:
        raise FlashnextError(f"flashnext bench needs {', '.join(missing)}: pip install 'flashnext[bench]'")
    from flashnext.serving.bench import Bench, Settings, load_report, write_outputs
    from flashnext.serving.bench.client import Malformed, parse_strict

    try:
        extra = parse_strict(given["extra_body"], "--extra-body")
    except Malformed as e:
        raise FlashnextError(f"--extra-body is not JSON a request can carry ({str(e).removeprefix('--extra-body: ')})") from None
    if not isinstance(extra, dict):
        raise FlashnextError("--extra-body must be a JSON object")
    if against and baseline:
        raise UsageError("give --against or --baseline, not both")
    base = load_report(baseline) if baseline else None
    settings = Settings(**(given | {"phases": _phases(given["phases"]), "extra_body": extra}))
    if against_model and not against:
        raise UsageError("--against-model needs --against URL")
    bench = Bench(settings, [url, against] if against else [url], models=[model, against_model or model],
                  baseline=base, allow_different_settings=allow_different_settings)
    _check_out(out, force)
    if progress:
        from tqdm import tqdm

        with tqdm(total=bench.planned_requests(), unit="req", desc="bench", dynamic_ncols=True) as bar:
            bench.progress = bar.update
            report = bench.run()
    else:
        report = bench.run()
    files = write_outputs(report, out, force=force)
    from flashnext.serving.bench import summary

    problems, advice = summary.problems(report), summary.advice(report)
    if as_json:
        emit_json({"out": str(out), "files": files, "summary": summary.summary(report), "problems": problems,
                   "advice": advice})
    else:
        for line in summary.summary_lines(report):
            click.echo(line)
        for line in problems:
            click.echo(f"problem: {line}")
        for line in advice:
            click.echo(f"what to change: {line}")
        click.echo(f"wrote {out}/report.html ({', '.join(files)})")
    if fail_on_errors and problems:
        raise FlashnextError(f"{len(problems)} problem(s): {problems[0]}")


def command() -> click.Command:
    """``flashnext bench``, made from the phase registry as it is now (a test registers a phase and
    makes the command again)."""
    fn = user_errors(_run)
    fn = json_option(fn)
    for decorator in reversed([
        click.argument("url"),
        click.option("--against", "against", default=None, metavar="URL",
                     help='A second endpoint ("against"), measured side by side with URL ("this run"), round by round.'),
        click.option("--baseline", type=click.Path(path_type=Path, dir_okay=False), default=None,
                     help="A report.json of an earlier run (e.g. with a patch switch off) to A/B this run against."),
        click.option("--allow-different-settings", is_flag=True,
                     help="Compare with a --baseline measured with other settings (the report lists them)."),
        click.option("--model", default=None, help="Served model name; default: the first of the server's /v1/models."),
        click.option("--against-model", default=None,
                     help="The --against server's model name, if not the same as --model."),
        # an existing file is refused by _check_out in one line, not by click (file_okay) as a usage error
        click.option("--out", type=click.Path(path_type=Path), metavar="DIRECTORY", required=True,
                     help="Output directory: report.json, PNG plots, report.html."),
        click.option("--force", is_flag=True, help="Replace --out if an earlier flashnext bench made it."),
        *(_click_option(o) for o in setting_options()),
        click.option("--fail-on-errors", is_flag=True,
                     help="Exit 1 when any request failed, an answer missed its needle or a structured answer is "
                          "invalid."),
        click.option("--progress/--no-progress", default=True, show_default=True,
                     help="Show a progress bar on stderr."),
    ]):
        fn = decorator(fn)
    return click.command("bench", help=_HELP.format(phases=_phase_lines()))(fn)


main = command()


def _check_out(out: Path, force: bool) -> None:
    """Refuse a taken --out before the run, not after an hour of measuring."""
    from flashnext.errors import FlashnextError
    from flashnext.quant.checkpoint.fsutil import require_flashnext_output
    from flashnext.serving.bench.output import MADE_BY

    if out.exists() or out.is_symlink():
        if not force:
            raise FlashnextError(f"{out} already exists: choose another --out or pass --force")
        require_flashnext_output(out, MADE_BY)
