"""The one map from the library's input fields to the command-line flags that fill them.

A library error names the input it is about by the library's own name (``FlashnextError.field``,
``flashnext/errors.py``); what a user typed is a flag, so the commands show the flag instead
(:func:`as_typed`). A flag renamed here renames it in every message.
"""

from __future__ import annotations

from flashnext.errors import FlashnextError, fields_shown

# field (a library parameter's name) -> the flag a command fills it from
FLAGS: dict[str, str] = {
    "calib": "--calib",
    "quantizer": "--quantizer",
    "targets": "--targets",
    "force_slower": "--force-slower",
    "fmt": "--format",
    "cache_dir": "--cache-dir",
    "out": "--out",
    "report": "--report",
    "force": "--force",
    "reverse": "--reverse",
    "to": "--to",
    "profile": "--profile",
    "model": "--model",
    "overlay": "--overlay",
    "ple_table": "--ple-table",
    "bind": "--bind",
    "engine": "--engine",
    "grant": "--grant",
    "gpus": "--gpus",
    "gpu_memory": "--gpu-memory",
    "host_ram": "--host-ram",
    "context": "--context",
    "ple_format": "--ple-format",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "against": "--against",
    "baseline": "--baseline",
    "allow_different_settings": "--allow-different-settings",
    "vllm": "--vllm",
    "target": "--target",
}


def flag_of(field: str) -> str:
    return FLAGS.get(field, field)


def as_typed(error: FlashnextError) -> str:
    """``error``'s message as the command line shows it: its field, and every input the message
    names (:func:`~flashnext.errors.named`), by the flag that fills it."""
    field = getattr(error, "field", None)
    if not field:
        return fields_shown(Exception.__str__(error), flag_of)
    return fields_shown(f"{flag_of(field)} {error.message}", flag_of)
