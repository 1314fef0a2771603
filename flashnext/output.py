"""What vLLM and torch print while they import, plan or parse, held back: a command's answer is its
first line, and a refusal its only one."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile


@contextlib.contextmanager
def held_back_output():
    """Hold back what vLLM and torch print while they import and plan (deprecations, "no CUDA
    runtime", vLLM's platform notes; from Python loggers and from C, on stdout and stderr), so that
    a command's answer is its first line. With ``FLASHNEXT_DEBUG=1`` a failure replays it first."""
    from flashnext.envs import FLASHNEXT_DEBUG

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        saved = os.dup(1), os.dup(2)
    except OSError:  # stdout or stderr closed: nothing to keep clean
        yield
        return
    failed = False
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
            if failed and FLASHNEXT_DEBUG.enabled():
                sink.seek(0)
                os.write(2, sink.read())
