"""``flashnext demo-checkpoint``: write the embedded miniature Qwen3.8-Flash-Next snapshot."""

from __future__ import annotations

from pathlib import Path

import click

from flashnext.tools._common import begin, emit_json, json_option, user_errors


@click.command("demo-checkpoint")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Directory to create.")
@click.option("--force", is_flag=True, help="Replace an existing --out.")
@json_option
@user_errors
def main(out: Path, force: bool, as_json: bool) -> None:
    """Write a miniature Qwen3.8-Flash-Next snapshot (about 10 MB): real tensor names, config
    keys and INT4/INT6/INT8 compressed-tensors layout, random heavy-tailed weights, the same
    bytes on every run."""
    from flashnext.quant.checkpoint.fsutil import refuse_existing_output
    from flashnext.quant.demo import MADE_BY, write_demo_checkpoint

    refuse_existing_output(out, force, made_by=MADE_BY)  # before the config's compressed-tensors import brings in torch
    begin(f"writing the demo checkpoint to {out} (about 10 MB; torch loads first)")
    summary = write_demo_checkpoint(out, force=force)
    if as_json:
        emit_json(summary)
    else:
        click.echo(f"wrote {summary['path']}: {summary['tensors']} tensors in {summary['shards']} shards")


if __name__ == "__main__":
    main()
