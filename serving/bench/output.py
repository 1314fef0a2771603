"""The run's output directory: report.json, the plots, report.html; whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

from flashnext.quant.checkpoint.fsutil import atomic_directory, write_new
from flashnext.serving.bench.plots import html_page, render
from flashnext.serving.bench.report import BenchReport


def report_json(report: BenchReport) -> str:
    """``report`` as strict JSON. The report's models hold finite floats only, so allow_nan=False
    cannot fail on a report; it is there so that no later field can bring NaN back unnoticed."""
    return json.dumps(report.model_dump(mode="json"), indent=1, allow_nan=False) + "\n"


def write_outputs(report: BenchReport, out: Path, force: bool = False) -> list[str]:
    """Write ``out/`` (``--force`` replaces only an earlier flashnext output); the files written."""
    # Everything that could fail is made before the directory is: a failure leaves nothing behind.
    pngs = render(report)
    files = {"report.json": report_json(report).encode("utf-8"), **pngs,
             "report.html": html_page(report, pngs).encode("utf-8")}
    with atomic_directory(Path(out), force=force, made_by="flashnext bench", held=True) as tmp:
        for name, data in files.items():
            write_new(tmp / name, data)
    return list(files)
