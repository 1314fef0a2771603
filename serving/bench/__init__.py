"""Measure a served endpoint as seed 000 does: TTFT, ITL, decode tok/s, needle, structured output, A/B.

The library behind ``flashnext bench``: :class:`~flashnext.serving.bench.runner.Bench` runs the
phases against one OpenAI-compatible server or two side by side and returns a
:class:`~flashnext.serving.bench.report.BenchReport`; :func:`write_outputs` writes it with its plots
and HTML page.
"""

from flashnext.serving.bench.output import write_outputs
from flashnext.serving.bench.report import BenchReport, Settings, load_report
from flashnext.serving.bench.runner import PHASES, Bench

__all__ = ["Bench", "BenchReport", "PHASES", "Settings", "load_report", "write_outputs"]
