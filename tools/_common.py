"""What every command shares: one-line errors, JSON output, ``-h``, the preflight's report."""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import sys
import threading

import click

from flashnext.errors import (EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED, FlashnextError, Terminated, UsageError,
                              exit_code)


# -h as well as --help. Click hands help_option_names down from the root context, so this is set on
# each root only: the flashnext group, and the commands that are also console scripts of their own
# (make-mtp-int4, serve).
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}


@contextlib.contextmanager
def _one_line_usage():
    """A usage error click finds while it parses a line (an unknown option, a missing value, no such
    command) as one line: click prints a usage block and a hint above the error where the error
    carries its context, so the context becomes the line's pointer to --help instead."""
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:  # a group run bare: its help is the answer
        raise
    except click.UsageError as e:
        if e.ctx is None:
            raise
        raise click.UsageError(f"{e.format_message()} (see `{e.ctx.command_path} --help`)") from None


class _OneLineUsage:
    """For each root (the classes below): a usage error anywhere under it is one line, exit 2."""

    def make_context(self, info_name, args, parent=None, **extra):
        with _one_line_usage():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        with _one_line_usage():
            return super().invoke(ctx)


class RootCommand(_OneLineUsage, click.Command):
    """A command that is also a console script of its own (make-mtp-int4)."""


class RootGroup(_OneLineUsage, click.Group):
    """A group that is a console script (flashnext, serve)."""


def begin_preflight(profile: str, engine: str) -> None:
    """The preflight's first line, said before the profile is resolved (its vllm_args go through
    vLLM's own parser, which imports vLLM: seconds)."""
    begin(f"preflight of {profile}: GPUs, host memory, limits, the PLE table, overlays, the {engine} engine")


def begin(line: str) -> None:
    """A command's first line, at once: what it does while its imports and first work take seconds
    (torch, vLLM). On stderr, and only where a person watches it (a terminal), so that stdout stays
    the command's output and logs and pipes get no more than before."""
    if sys.stderr.isatty():
        click.echo(f"{line} ...", err=True)


class InternalError(click.ClickException):
    exit_code = EXIT_INTERNAL


class UserError(click.ClickException):
    """A :class:`FlashnextError` as click prints it: ``Error: <one line>``, with the table's exit code."""

    def __init__(self, error: FlashnextError):
        super().__init__(_first_line(error))
        self.exit_code = exit_code(error)


def _first_line(e: BaseException) -> str:
    from flashnext.quant.checkpoint.fsutil import display_path
    from flashnext.tools._flags import as_typed

    text = (as_typed(e) if isinstance(e, FlashnextError) else str(e)).strip()
    return display_path(text.splitlines()[0]) if text else type(e).__name__


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises :class:`~flashnext.errors.Terminated` (a KeyboardInterrupt) while the block
    runs, so that it ends a command as Ctrl-C does: through every ``finally`` (scratch directories
    and partial outputs removed, a resumable build's journal kept, a server the selftest started
    stopped) rather than at once, leaving them. Only the main thread can set a handler; elsewhere
    (a command invoked from a thread) SIGTERM keeps its disposition."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        # A second SIGTERM (sent again while the first one's cleanup runs) must not cut it short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def user_errors(fn):
    """Every failure as one line on stderr and a non-zero exit from ``flashnext.errors.EXIT_CODES``:
    a :class:`FlashnextError` (bad input, a bad environment, a verdict already printed), a click
    usage error the command raises itself (exit 2, as :class:`~flashnext.errors.UsageError`) and an
    OS error; anything else is a flashnext bug, reported in one line with exit 70
    (``FLASHNEXT_DEBUG=1`` shows the traceback). Ctrl-C and SIGTERM end it after its cleanup, with
    exit 130 and 143."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with sigterm_as_interrupt():
                return fn(*args, **kwargs)
        except FlashnextError as e:
            if e.printed:
                sys.exit(exit_code(e))
            raise UserError(e) from None
        except click.UsageError as e:
            # A usage error the command found itself (click's raised in its body, not while click
            # parsed the line): one line, as UsageError's, not click's usage block.
            raise UserError(UsageError(e.format_message())) from None
        except OSError as e:  # a permission, a full disk, a vanished file: one line, not a traceback
            from flashnext.quant.checkpoint.fsutil import display_path

            where = f": {display_path(str(e.filename))}" if getattr(e, "filename", None) else ""
            raise click.ClickException(f"{e.strerror or _first_line(e)}{where}") from None
        except Terminated:
            click.echo("terminated", err=True)
            sys.exit(EXIT_TERMINATED)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
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


def _as_typed(finding):
    """A preflight finding with the inputs its quoted errors name shown as flags."""
    import dataclasses

    from flashnext.errors import fields_shown
    from flashnext.tools._flags import flag_of

    return dataclasses.replace(finding, detail=fields_shown(finding.detail, flag_of),
                               fix=finding.fix and fields_shown(finding.fix, flag_of))


def preflight_report(deployment, engine: str, as_json: bool, err: bool = False) -> None:
    """Run the preflight (``doctor``, ``serve --check``, ``serve`` before it starts) of ``deployment``
    (a :class:`~flashnext.serving.deployment.Deployment`, judged as resolved: nothing loaded again),
    print go/no-go with each fix (on stderr with ``err``), and raise
    :class:`~flashnext.errors.NoGo` with the first blocking finding's exit code."""
    from flashnext.errors import NoGo
    from flashnext.output import held_back_output
    from flashnext.serving.preflight import preflight, verdict

    with held_back_output():
        findings = [_as_typed(f) for f in preflight(deployment, engine)]
    code = verdict(findings)
    if as_json:
        emit_json({"go": code == 0, "exit_code": code, "findings": [f.to_json() for f in findings]})
    else:
        for f in findings:
            mark = "ok  " if f.ok else ("FAIL" if f.blocking else "warn")
            click.echo(f"[{mark}] {f.check}: {f.detail}", err=err)
            if not f.ok and f.fix:
                click.echo(f"       fix: {f.fix}", err=err)
        click.echo("GO" if code == 0 else f"NO-GO (exit {code})", err=err)
    if code:
        raise NoGo(f"NO-GO (exit {code})", code)
