"""Ctrl-C and SIGTERM held off for the few steps between making something on disk and the ``try``
that removes it.

A command's partial directory or temporary file is removed by the ``except``/``finally`` around its
use; an interrupt landing after the ``mkdir`` or ``open`` returned but before that ``try`` began
would leave it behind (CI saw a ``.report.partial-PID`` left by a SIGTERM that reached ``selftest``
just after its mkdir). Python runs a signal's handler between bytecodes, so no ordering of statements
closes that gap; holding the handlers off for those steps does.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

_HELD = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM received while the block runs are delivered when it ends, to the handlers
    they would have met (so a SIGTERM still raises :class:`~flashnext.errors.Terminated`, a second one
    is still ignored). Open it inside the ``try`` whose cleanup removes what the block makes, and
    assign what it makes within the block: the held interrupt then raises where that cleanup runs.
    Only the main thread runs Python's signal handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: pending.append(signum)) for signum in _HELD}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)
