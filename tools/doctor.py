"""``flashnext doctor`` (also ``serve --check``): can this machine run a profile?"""

from __future__ import annotations

from pathlib import Path

import click

from flashnext.tools._common import begin_preflight, json_option, preflight_report, user_errors


@click.command("doctor")
@click.option("--profile", required=True, help="Serving profile to check for.")
@click.option("--model", type=click.Path(path_type=Path), default=None, help="The base snapshot (to verify overlays).")
@click.option("--overlay", "overlays", multiple=True, type=click.Path(path_type=Path),
              help="An overlay serve would apply, in order (repeatable): checked against --model.")
@click.option("--ple-table", type=click.Path(path_type=Path), default=None,
              help="The PLE table file (checked, and its drive); without it the table counts as pinned host memory.")
@click.option("--engine", type=click.Choice(["docker", "podman", "native"]), default="docker", show_default=True,
              help="How serve would run it: the image is checked for docker and podman, not for native.")
@json_option
@user_errors
def main(profile: str, model: Path | None, overlays: tuple[Path, ...], ple_table: Path | None, engine: str,
         as_json: bool) -> None:
    """Preflight for a serving profile: GPUs, every pinned host byte against RAM (QSA K/V, a pinned
    PLE table, the MTP draft embedding, the streamed ViT), memory limits, ptrace, the PLE table and
    its drive, overlays, the image. Prints go/no-go with the fix for each problem; exit 0 (go),
    10 GPU, 11 memory, 12 ptrace, 13 PLE table or its drive, 14 overlay, 15 image. `serve` runs it
    before it starts anything."""
    from flashnext.serving.deployment import resolve_deployment

    begin_preflight(profile, engine)
    preflight_report(resolve_deployment(profile, model, overlays, ple_table), engine, as_json)
