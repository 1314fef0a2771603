"""What every command shares: one-line errors, JSON output."""

from __future__ import annotations

import functools
import json
import sys

import click

from flashnext.errors import FlashnextError


EXIT_INTERNAL = 70  # EX_SOFTWARE: a flashnext bug, not the user's input


class InternalError(click.ClickException):
    exit_code = EXIT_INTERNAL


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def user_errors(fn):
    """Every failure as one line on stderr and a non-zero exit: a :class:`FlashnextError` (bad
    input, a bad environment) and an OS error exit 1; anything else is a flashnext bug, reported
    in one line with exit 70 (``FLASHNEXT_DEBUG=1`` shows the traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FlashnextError as e:
            raise click.ClickException(_first_line(e)) from None
        except OSError as e:  # a permission, a full disk, a vanished file: one line, not a traceback
            where = f": {e.filename}" if getattr(e, "filename", None) else ""
            raise click.ClickException(f"{e.strerror or _first_line(e)}{where}") from None
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit):
            raise
        except Exception as e:
            from flashnext.envs import FLASHNEXT_DEBUG

            if FLASHNEXT_DEBUG.enabled():
                raise
            raise InternalError(f"internal error: {type(e).__name__}: {_first_line(e)} (a flashnext bug; "
                                "FLASHNEXT_DEBUG=1 shows the traceback)") from None

    return wrapper


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


json_option = click.option("--json", "as_json", is_flag=True,
                           help="Print a machine-readable JSON result on stdout.")
