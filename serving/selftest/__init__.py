"""``flashnext selftest``: check a machine before the 125B model is loaded on it.

The CPU part (the patch series against the installed vLLM, and the demo checkpoint's quantized
layers against the GPU kernels vLLM picks for them) runs on any CPU with vLLM installed (the
``serve`` extra); the GPU part serves the demo checkpoint through the patched vLLM and A/Bs each
patch's switch. :func:`~.runner.selftest` runs both and writes ``report.json`` (schema ``manifests/selftest-report.schema.json``) and ``report.html``.
"""

from flashnext.serving.selftest.report import SelftestReport, load_report
from flashnext.serving.selftest.runner import SelftestFailed, selftest

__all__ = ["SelftestFailed", "SelftestReport", "load_report", "selftest"]
