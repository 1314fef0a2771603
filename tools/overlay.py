"""``flashnext overlay``: verify overlays against a snapshot and apply them as a view."""

from __future__ import annotations

from pathlib import Path

import click

from flashnext.quant.errors import FlashnextError
from flashnext.tools._common import emit_json, json_option, user_errors

EXIT_MISMATCH = 3


@click.group("overlay")
def main() -> None:
    """Overlays: check them against a base snapshot, and apply them without copying."""


@main.command("verify")
@click.argument("target", type=click.Path(path_type=Path))
@click.option("--base", type=click.Path(path_type=Path), default=None,
              help="The base snapshot (not needed when TARGET is a view made by `overlay apply`).")
@click.option("--full", is_flag=True, help="Hash base files' whole content, not only their safetensors headers.")
@json_option
@user_errors
def verify(target: Path, base: Path | None, full: bool, as_json: bool) -> None:
    """Check an OVERLAY against --base, or every overlay of a VIEW against its base.

    Overlay files are always checked by content hash; base files by their safetensors header hash
    (by content with --full). Each mismatch is one line; exit status 3 if there is any."""
    from flashnext.quant.overlay_view import read_view, verify_overlay, verify_view

    if not target.exists():
        raise FlashnextError(f"{target}: no such overlay or view")
    if base is None:
        if read_view(target) is None:
            raise FlashnextError(f"{target} is not a view: pass --base SNAPSHOT to verify an overlay")
        problems = verify_view(target, full)
    else:
        problems = verify_overlay(base, target, full)
    if as_json:
        emit_json({"ok": not problems, "mismatches": [{"path": p.path, "problem": p.problem} for p in problems]})
    else:
        for p in problems:
            click.echo(f"mismatch: {p}", err=True)
        if not problems:
            click.echo(f"ok: {target}")
    if problems:
        raise SystemExit(EXIT_MISMATCH)


@main.command("apply")
@click.argument("overlays", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--base", type=click.Path(path_type=Path), required=True, help="The base snapshot.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The view directory to create.")
@click.option("--force", is_flag=True, help="Replace an existing view.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check each overlay against the base first (header hashes).")
@json_option
@user_errors
def apply(overlays: tuple[Path, ...], base: Path, out: Path, force: bool, verify: bool, as_json: bool) -> None:
    """Make a view of --base with OVERLAYS applied in order: symlinks, nothing large copied.
    `vllm serve VIEW` loads it like a snapshot."""
    from flashnext.quant.overlay_view import apply_overlays

    result = apply_overlays(base, list(overlays), out, verify=verify, force=force)
    if as_json:
        emit_json(result)
    else:
        click.echo(f"wrote view {result['view']} ({len(overlays)} overlay(s) over {result['base']})")
