"""The probe interpreter: runs every patch's probe against a vLLM tree, one event line each.

``python -m flashnext.serving.patches.probe_runner TREE PROBES EVENTS``, started by
``serving/patch_series.py`` with TREE first on ``PYTHONPATH``: PROBES is a JSON file of
``[[id, probe module, probe function, its arguments, touched files], ...]``; to EVENTS it appends one
JSON line per event (``{"fatal": ...}``, ``{"start": id}``, ``{"id": id, "error": line or null}``),
flushed at once, so that the caller can follow the probes as they finish and tell which one a
crash ended. Probes share the interpreter (one vLLM import instead of one per patch), each in its
own function's namespace.

It imports only the standard library before vLLM: the check that vLLM comes from TREE must see the
first import of it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback


def last_error_line(exc: BaseException, probe_file: str | None = None) -> str:
    """The exception's last line, and where in the probe's own file it was raised."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == probe_file]
    where = (f" ({os.path.basename(probe_file)} line {frames[-1].lineno}: {frames[-1].line})"
             if frames and frames[-1].line else "")
    return traceback.format_exception_only(type(exc), exc)[-1].strip() + where


def main(argv: list[str]) -> int:
    root, probes_file, events_file = argv[:3]
    events = open(events_file, "a")

    def event(**fields) -> None:
        events.write(json.dumps(fields) + "\n")
        events.flush()

    try:
        import vllm
        origin = os.path.abspath(vllm.__file__)
        if not origin.startswith(os.path.join(root, "vllm") + os.sep):
            raise ImportError(f"the probes import vllm from {origin}, not from the patched shadow tree {root}")
    except BaseException as exc:
        event(fatal=last_error_line(exc))
        return 1
    with open(probes_file) as f:
        probes = json.load(f)
    for patch_id, module_name, function_name, args, touched in probes:
        event(start=patch_id)
        probe_file = None
        try:
            module = importlib.import_module(module_name)
            probe_file = module.__file__
            getattr(module, function_name)(*args)
            for rel in touched:  # a touched module the probe imported must be the tree's patched copy
                imported = sys.modules.get(rel[:-len(".py")].replace("/", ".").removesuffix(".__init__"))
                if imported is not None and os.path.abspath(imported.__file__) != os.path.join(root, rel):
                    raise ImportError(f"{imported.__name__} was imported from {imported.__file__}, not the shadow tree")
        except BaseException as exc:
            event(id=patch_id, error=last_error_line(exc, probe_file))
        else:
            event(id=patch_id, error=None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
