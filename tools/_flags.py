"""The one map from the library's input fields to the command-line flags that fill them.

A library error names the input it is about by the library's own name (``FlashnextError.field``,
``flashnext/errors.py``); what a user typed is a flag, so the commands show the flag instead
(:func:`as_typed`). A flag renamed here renames it in every message.
"""

from __future__ import annotations

from flashnext.errors import FlashnextError

# field (a library parameter's name) -> the flag a command fills it from
FLAGS: dict[str, str] = {
    "calib": "--calib",
    "quantizer": "--quantizer",
    "targets": "--targets",
    "force_slower": "--force-slower",
    "fmt": "--format",
    "cache_dir": "--cache-dir",
}


def as_typed(error: FlashnextError) -> str:
    """``error``'s message as the command line shows it: its field named by the flag that fills it."""
    field = getattr(error, "field", None)
    if not field:
        return str(error)
    return f"{FLAGS.get(field, field)} {error.message}"
