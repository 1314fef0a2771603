"""flashnext's vLLM general plugin: the entry point vLLM calls in every process it starts.

vLLM loads the ``vllm.general_plugins`` entry points (pyproject.toml names :func:`register`) in the
API server, the engine core and every worker, before a model is built; ``VLLM_PLUGINS`` (vLLM's own
allow-list) leaves flashnext out when it does not name ``flashnext``. What the plugin registers is
the series' plugin entries (``serving/patches/series.py``: a patch whose verdict is ``plugin``
names its registration), so a patch moved to a plugin point is one registry entry, not a diff.

vLLM may call this more than once in a process and in several processes: each registration must be
idempotent. Nothing is imported from vLLM here until a registration runs.
"""

from __future__ import annotations

import importlib

# What vLLM's allow-list (VLLM_PLUGINS) calls this plugin: the entry point's name in pyproject.toml.
PLUGIN_NAME = "flashnext"


def registrations() -> list[tuple[str, str]]:
    """``(patch id, dotted path of its registration)`` for every plugin entry of the series."""
    from flashnext.serving.patches.series import SERIES

    return [(p.id, p.registers) for p in SERIES if p.registers is not None]


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def register() -> None:
    """Run every plugin entry's registration once (vLLM's ``load_general_plugins`` calls this);
    entries served by one registration (decode-06 and ttft-01: one model class) name the same."""
    for dotted in dict.fromkeys(dotted for _, dotted in registrations()):
        _resolve(dotted)()
