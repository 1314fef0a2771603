"""Measure a served endpoint as seed 000 does: TTFT, ITL, decode tok/s, needle, structured output, A/B.

The library behind ``flashnext bench``: :class:`~flashnext.serving.bench.runner.Bench` runs the
phases (:data:`~flashnext.serving.bench.phases.PHASES`) against one OpenAI-compatible server or two
side by side and returns a :class:`~flashnext.serving.bench.report.BenchReport`;
:func:`write_outputs` writes it with its plots and HTML page.

The names below are loaded when first used: ``flashnext bench`` makes its options from the phase
registry, a subpackage of this one, and must load without the bench extra (httpx, jsonschema,
matplotlib) to say what to install.
"""

from __future__ import annotations

import importlib

_HOMES = {"Bench": "runner", "BenchReport": "report", "PHASES": "phases", "Settings": "report",
          "load_report": "report", "write_outputs": "output"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
