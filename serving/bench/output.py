"""The run's output directory: report.json, the plots, report.html; whole or not at all.

The plots and the page are put together here from the phases' parts (in the registry's order) and
the parts no one phase owns (``plots``), so that the page follows the phases a run has.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from flashnext.quant.checkpoint.fsutil import atomic_directory, write_new
from flashnext.serving.bench import plots
from flashnext.serving.bench.phases import PHASES
from flashnext.serving.bench.report import BenchReport

MADE_BY = "flashnext bench"  # the command, in its --out's marker: only its --force replaces the folder


def report_json(report: BenchReport) -> str:
    """``report`` as strict JSON. The report's models hold finite floats only, so allow_nan=False
    cannot fail on a report; it is there so that no later field can bring NaN back unnoticed."""
    return json.dumps(report.model_dump(mode="json"), indent=1, allow_nan=False) + "\n"


def render(report: BenchReport) -> dict[str, bytes]:
    """Every plot the report has data for, by file name, in the page's order. Every registered
    phase is asked, not only those that ran: a picture can pool what several phases measured."""
    made = {name: png for p in PHASES.values() for name, png in p.plots(report).items()}
    made["ab.png"] = plots.ab_plot(report)
    return {name: png for name, png in made.items() if png is not None}


def html_page(report: BenchReport, pngs: dict[str, bytes]) -> str:
    """One page, images inline: it can be mailed or attached to an issue as it is."""
    parts = [f"<h1>flashnext bench</h1><p>flashnext {html.escape(report.flashnext_version)}, "
             f"{html.escape(report.started_at)} to {html.escape(report.finished_at)}</p>"]
    for e in report.endpoints:
        parts += plots.endpoint_html(e)
        for p in PHASES.values():
            parts += p.html(e)
    if report.ab:
        parts += plots.ab_html(report)
    for name, png in pngs.items():
        data = base64.b64encode(png).decode()
        parts.append(f'<figure><img alt="{name}" src="data:image/png;base64,{data}"></figure>')
    if report.notes:
        parts.append("<h2>Notes</h2>" + "".join(f"<p>{html.escape(n)}</p>" for n in report.notes))
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;"
             "margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}th{background:#f4f4f4}"
             "td.n{text-align:right}td.t{text-align:left}.bad{color:#a00}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset=utf-8><title>flashnext bench</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")


def write_outputs(report: BenchReport, out: Path, force: bool = False) -> list[str]:
    """Write ``out/`` (``--force`` replaces only an earlier flashnext output); the files written."""
    # Everything that could fail is made before the directory is: a failure leaves nothing behind.
    pngs = render(report)
    files = {"report.json": report_json(report).encode("utf-8"), **pngs,
             "report.html": html_page(report, pngs).encode("utf-8")}
    with atomic_directory(Path(out), force=force, made_by=MADE_BY, held=True) as tmp:
        for name, data in files.items():
            write_new(tmp / name, data)
    return list(files)
