"""The run's output directory: report.json, the plots, report.html; whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

from flashnext.quant.checkpoint.fsutil import atomic_directory
from flashnext.serving.bench.plots import render, write_html
from flashnext.serving.bench.report import BenchReport


def write_outputs(report: BenchReport, out: Path, force: bool = False) -> list[str]:
    """Write ``out/`` (``--force`` replaces only an earlier flashnext output); the files written."""
    pngs = render(report)
    with atomic_directory(Path(out), force=force, made_by="flashnext bench") as tmp:
        (tmp / "report.json").write_text(json.dumps(report.model_dump(mode="json"), indent=1) + "\n")
        for name, png in pngs.items():
            (tmp / name).write_bytes(png)
        write_html(report, pngs, tmp / "report.html")
    return ["report.json", *pngs, "report.html"]
