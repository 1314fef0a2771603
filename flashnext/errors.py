"""User-facing errors, and the exit code of each.

A :class:`FlashnextError` is bad input or a bad environment, not a bug: the command lines print
its message as one line and exit with :data:`EXIT_CODES` of its type, without a traceback. A few
outcomes are verdicts rather than failures of the command (a verification that found mismatches,
a drive too slow for the PLE table, a preflight NO-GO): they are errors of their own type too, so
that every non-zero exit of every command comes from the one table below.
"""

from __future__ import annotations

import enum
import re


# What marks an input named inside a message (:func:`named`): NUL, which no path holds.
_NAMED = re.compile("\0(\\w+)\0")


def named(field: str) -> str:
    """``field`` (an input, by the library's name for it) named inside an error's message, say in
    its advice ("choose another {named('out')}"): ``str()`` shows the field, a command the flag that
    fills it (``tools/_flags.py``)."""
    return f"\0{field}\0"


def fields_shown(text: str, show=lambda field: field) -> str:
    """``text`` with each input :func:`named` in it shown as ``show(field)``."""
    return _NAMED.sub(lambda m: show(m[1]), text)


def said(error: BaseException) -> str:
    """``error``'s line for another text to quote (a preflight finding): ``str()``'s, with the inputs
    it names still marked (:func:`named`), so that a command shows them as flags there too."""
    if isinstance(error, FlashnextError):
        return f"{named(error.field)} {error.message}" if error.field else Exception.__str__(error)
    return str(error)


class FlashnextError(Exception):
    """An error a user can act on. The message is one line and says what to do.

    ``field``: the input the error is about, by the library's own name for it (``"calib"``, the
    parameter); the message then follows that name (``str()`` is ``"calib /x: no such file"``). The
    library never names a command-line flag: a command shows the flag its option fills the field
    from instead of the field (``tools/_flags.py``), and so for every other input the message names
    (:func:`named`)."""

    # A verdict the command has already printed in full: only its exit status is left to give.
    printed = False

    def __init__(self, message: str = "", *args, field: str | None = None):
        super().__init__(message, *args)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return fields_shown(f"{self.field} {self.message}" if self.field else super().__str__())


class UsageError(FlashnextError):
    """The command line is wrong, not its input: options that cannot go together, or one that another
    needs is missing. The same exit status as click's own usage errors (an unknown option, a missing
    required one)."""


class VerificationMismatch(FlashnextError):
    """A verification found data that differs from what was recorded, whichever command verified:
    ``overlay verify`` prints every file that differs from its manifest's hash and then gives this
    verdict (``printed``); ``ple verify`` stops at a table's first block that differs from its
    sidecar and gives the finding as the message (``printed=False``). Input that cannot be read
    at all (no sidecar, a malformed one) is a plain :class:`FlashnextError`, not a verdict."""

    def __init__(self, message: str, printed: bool = True):
        super().__init__(message)
        self.printed = printed


class SlowDrive(FlashnextError):
    """``ple drive-check``: the drive's read-latency tail would stall decode (the verdict was printed)."""

    printed = True


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``timeout``, ``docker stop`` and systemd send), raised where the command is, as
    Ctrl-C raises KeyboardInterrupt: every cleanup Ctrl-C runs runs for it too (tools/_common.py)."""


class NoGoCode(enum.IntEnum):
    """The preflight's exit status per kind of blocking finding (``flashnext doctor``, ``serve``)."""

    GO = 0
    GPU = 10
    MEMORY = 11
    PTRACE = 12
    PLE = 13  # the PLE table or its drive
    OVERLAY = 14
    IMAGE = 15


class NoGo(FlashnextError):
    """The preflight's verdict: a blocking finding; ``exit_code`` is that finding's
    (:class:`NoGoCode`)."""

    printed = True

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# Exit codes of the command lines (0: success). README.md's "Exit codes" section says the same
# (tests/test_cli_consistency.py holds them together).
EXIT_CODES: dict[type[FlashnextError], int] = {
    FlashnextError: 1,
    UsageError: 2,  # click's own exit status for its usage errors
    VerificationMismatch: 3,
    SlowDrive: 4,  # a verdict on the drive, not the command line's mistake (2 is for those)
    # NoGo: its NoGoCode (10-15), carried by the error itself.
}
EXIT_INTERNAL = 70  # EX_SOFTWARE: a flashnext bug, not the user's input
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
EXIT_TERMINATED = 143  # 128 + SIGTERM: what a shell showed while SIGTERM killed flashnext outright, kept


def exit_code(error: FlashnextError) -> int:
    """The exit status for ``error``: its own (a NoGo's), else the table's for its nearest type."""
    if isinstance(error, NoGo):
        return error.exit_code
    for cls in type(error).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return EXIT_CODES[FlashnextError]
