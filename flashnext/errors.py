"""User-facing errors.

A :class:`FlashnextError` is bad input or a bad environment, not a bug: the command lines print
its message as one line and exit non-zero, without a traceback.
"""


class FlashnextError(Exception):
    """An error a user can act on. The message is one line and says what to do."""
