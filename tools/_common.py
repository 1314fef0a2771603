"""What every command shares: one-line errors, JSON output."""

from __future__ import annotations

import functools
import json
import sys

import click

from flashnext.quant.errors import FlashnextError


def user_errors(fn):
    """Turn a :class:`FlashnextError` into ``Error: <one line>`` and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FlashnextError as e:
            raise click.ClickException(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        except OSError as e:  # a permission, a full disk, a vanished file: one line, not a traceback
            where = f": {e.filename}" if getattr(e, "filename", None) else ""
            raise click.ClickException(f"{e.strerror or type(e).__name__}{where}") from None
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


json_option = click.option("--json", "as_json", is_flag=True,
                           help="Print a machine-readable JSON result on stdout.")
