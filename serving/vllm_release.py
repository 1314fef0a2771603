"""Which vLLM release flashnext serves with, and what is installed here: one line for ``doctor``,
``serve`` and ``selftest``.

The supported release is the one the series' diffs are cut against (``series.VLLM_VERSION``). vLLM
is found by its distribution's metadata, never imported (the commands start without it).
"""

from __future__ import annotations

import importlib.metadata

from flashnext.serving.patches.series import VLLM_VERSION

# vLLM pins flashinfer-python 0.7.3, which PyPI does not serve, so pip cannot resolve vllm==0.34.0:
# vLLM itself without its requirements, then flashnext's serve extra, which lists them.
INSTALL = f"pip install --no-deps vllm=={VLLM_VERSION} && pip install 'flashnext[serve]'"


def installed_version() -> str | None:
    """The installed vLLM's version, or None when there is none."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def supported(version: str | None) -> bool:
    return version == VLLM_VERSION


def support_line(version: str | None) -> str:
    """One line: the installed vLLM against the supported release, with what to run if it is not."""
    if version is None:
        return f"vLLM is not installed here; flashnext serves with vLLM {VLLM_VERSION}: {INSTALL}"
    if supported(version):
        return f"vLLM {version} installed, the release flashnext supports"
    return (f"vLLM {version} installed, but flashnext's series is cut for vLLM {VLLM_VERSION}: {INSTALL} "
            f"(or `flashnext patches check` to see what this vLLM makes of it)")
