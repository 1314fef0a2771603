"""``flashnext repack-int6``: INT6 modules to the bit-plane layout, to INT8, or back."""

from __future__ import annotations

from pathlib import Path

import click

from flashnext.quant.formats.ct_config import DEFAULT_INT6_TARGETS
from flashnext.tools._common import begin, emit_json, json_option, user_errors


@click.command("repack-int6")
@click.option("--src", type=click.Path(path_type=Path), required=True, help="The snapshot (never modified).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The overlay directory to create.")
@click.option("--targets", default=DEFAULT_INT6_TARGETS, show_default=True,
              help="Regular expression (re.match) over module names; bit planes outside the shared experts "
                   "are refused (measured slower than stock vLLM's kernel) unless --force-slower.")
@click.option("--reverse", is_flag=True, help="Turn bit-plane tensors of SRC (overlay applied) back into dense 6-bit.")
@click.option("--to", "to", type=click.Choice(["int8"]), default=None,
              help="Widen losslessly to INT8 (q+128) instead, for stock vLLM's 8-bit path (+33% bytes).")
@click.option("--force-slower", is_flag=True,
              help="Repack --targets outside the shared experts too, where bit planes measured slower.")
@click.option("--force", is_flag=True, help="Replace an existing --out.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar on stderr.")
@json_option
@user_errors
def main(src: Path, out: Path, targets: str, reverse: bool, to: str | None, force_slower: bool, force: bool,
         progress: bool, as_json: bool) -> None:
    """Repack compressed-tensors dense INT6 modules into the bit-plane layout the serving kernel reads
    (a 4-bit and a 2-bit plane, same bytes), or widen them to INT8, or reverse the bit-plane overlay."""
    if reverse and to:
        raise click.UsageError("--reverse and --to are exclusive")
    from flashnext.quant.checkpoint.fsutil import refuse_existing_output

    refuse_existing_output(out, force, {"the source snapshot": src})  # before the repack imports torch
    begin(f"repacking the INT6 modules of {src} into {out} (torch loads first)")
    from flashnext.quant.overlays.int6_repack import repack_int6

    mode = "reverse" if reverse else ("int8" if to == "int8" else "bitplane")
    report = repack_int6(src, out, targets, mode, force=force, progress=progress, force_slower=force_slower)
    if as_json:
        emit_json(report)
    else:
        click.echo(f"wrote {out}: {len(report['modules'])} modules in {len(report['shards'])} shard(s), {mode}")


if __name__ == "__main__":
    main()
