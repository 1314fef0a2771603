"""``flashnext ple``: the PLE n-gram table: layout, ids, the table file, residency, drive checks."""

from __future__ import annotations

import json
from pathlib import Path

import click

from flashnext.errors import FlashnextError, SlowDrive, UsageError, VerificationMismatch
from flashnext.sizes import format_size
from flashnext.tools._common import begin, emit_json, json_option, user_errors


# One PLE layer's table: vLLM hashes each PLE layer (0, 1, ... in ple_layer_ids order) with its own
# multipliers and head sizes.
layer_option = click.option("--layer", "dense_layer_id", type=int, default=0, show_default=True,
                            help="The PLE layer: its index in the config's ple_layer_ids.")


@click.group("ple")
def main() -> None:
    """The PLE n-gram table: hashing, the table file vLLM maps, page cache and drive checks."""


def _int_list(text: str | None, what: str) -> list[int]:
    if not text:
        return []
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers, got {text!r}") from None


def _text_config(path: Path) -> dict:
    from flashnext.quant.checkpoint.snapshot import read_config, text_config_of

    return text_config_of(read_config(path))


@main.command("ids")
@click.option("--config", "config_path", type=click.Path(path_type=Path), required=True,
              help="config.json of the model (text_config is used when present).")
@click.option("--tokens", required=True, help="Token ids, comma-separated.")
@click.option("--context", default=None, help="The ngram_size-1 tokens before them, oldest first (default: EOS).")
@layer_option
@user_errors
def ids(config_path: Path, tokens: str, context: str | None, dense_layer_id: int) -> None:
    """Print the [T, heads] row ids of TOKENS as a JSON list of lists (bit-identical to vLLM)."""
    from flashnext.quant.ple.hashing import NgramHasher

    from flashnext.quant.ple.layout import ple_layout

    layout = ple_layout(_text_config(config_path), dense_layer_id, f"{config_path}: text config")
    toks = _int_list(tokens, "--tokens")
    if not toks:
        raise UsageError("--tokens is empty")
    ctx = _int_list(context, "--context")
    if ctx and len(ctx) != layout.ngram_size - 1:
        raise FlashnextError(f"--context needs exactly {layout.ngram_size - 1} tokens")
    bad = next((t for t in toks + ctx if not 0 <= t < layout.vocab_size), None)
    if bad is not None:
        raise FlashnextError(f"token id {bad} is outside the vocabulary [0, {layout.vocab_size})")
    result = NgramHasher(layout).ids(toks, None, [ctx] if ctx else None)
    click.echo(json.dumps(result.tolist()))


@main.command("layout")
@click.option("--src", type=click.Path(path_type=Path), required=True, help="The model snapshot.")
@layer_option
@json_option
@user_errors
def layout_cmd(src: Path, dense_layer_id: int, as_json: bool) -> None:
    """Show the table layout, with the checkpoint's buffers winning over the formulas."""
    from flashnext.quant.ple.source import find_ple_source
    from flashnext.quant.checkpoint.snapshot import Snapshot

    source = find_ple_source(Snapshot.open(src), dense_layer_id)
    lay = source.layout
    # --layer counts PLE layers (0: the first id in ple_layer_ids); the decoder layer is where it sits.
    info = {"ple_layer": source.dense_layer_id, "decoder_layer": source.layer, "dtype": source.dtype,
            "row_elements": source.row_elements, "row_bytes": source.row_bytes, "rows": lay.rows,
            "padded_rows": lay.padded_rows, "file_size": source.file_size, "multipliers": list(lay.multipliers),
            "head_sizes": list(lay.head_sizes), "head_offsets": list(lay.head_offsets),
            "shards": len(source.shards), "shard_rows": lay.shard_rows, "differences": source.differences}
    if as_json:
        emit_json(info)
        return
    for k, v in info.items():
        click.echo(f"{k}: {v}")


@main.command("build")
@click.option("--src", type=click.Path(path_type=Path), required=True, help="The model snapshot (read only).")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="bf16: the table file to write; nvfp4/fp8: the overlay directory to write.")
@click.option("--format", "fmt", type=click.Choice(["bf16", "nvfp4", "fp8"]), default="bf16", show_default=True,
              help="bf16: the raw table file for VLLM_PLE_MMAP_PATH; nvfp4 or fp8: an overlay of the table "
                   "quantized, which vLLM's own PLE methods read (pinned host memory, no file).")
@click.option("--device", default="cpu", show_default=True,
              help="With --format nvfp4|fp8: where the rows are quantized (cpu, or cuda[:N]: the block search "
                   "is the build's cost).")
@layer_option
@click.option("--force", is_flag=True, help="Rebuild an existing table file or overlay flashnext made.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Show a progress bar of the bytes copied on stderr.")
@json_option
@user_errors
def build(src: Path, out: Path, fmt: str, device: str, dense_layer_id: int, force: bool, progress: bool,
          as_json: bool) -> None:
    """Write the raw table file vLLM maps (VLLM_PLE_MMAP_PATH) and its sidecar OUT.json, or with
    --format nvfp4|fp8 an overlay of the table in that format (every PLE layer's).

    An interrupted build, of either kind, resumes where it stopped when run again with the same
    arguments."""
    if fmt != "bf16" and click.get_current_context().get_parameter_source("dense_layer_id").name != "DEFAULT":
        raise UsageError("--layer is for the bf16 table file; --format nvfp4|fp8 quantizes every PLE layer's table")
    begin(f"building the PLE table of {src} as {fmt} into {out}")
    if fmt != "bf16":
        from flashnext.quant.overlays.ple_quant import quantize_ple_table

        report = quantize_ple_table(src, out, fmt, force=force, progress=progress, device=device)
        if as_json:
            emit_json(report)
            return
        click.echo(f"wrote {out}: the PLE table as {fmt} (ple_embedding_dtype {report['ple_embedding_dtype']})")
        for t in report["tables"]:
            line = f"{t['prefix']}: {t['rows']} rows, relative squared error {t['relative_mse']:.3e}"
            if "absmax_comparison" in t:
                c = t["absmax_comparison"]
                line += f" (on {c['rows']} sampled rows: {c['searched']:.3e} against absmax block scales' {c['absmax']:.3e})"
            click.echo(line)
        return
    if device != "cpu":
        raise UsageError("--device is for --format nvfp4|fp8; the bf16 table file is a copy")
    from flashnext.quant.ple.table import build_table

    result = build_table(src, out, dense_layer_id, force=force, progress=progress)
    if as_json:
        emit_json(result)
    else:
        click.echo(f"wrote {result['path']}: {result['rows']} rows x {result['row_bytes']} B "
                   f"({result['dtype']}, {format_size(result['file_size'])})")
        for line in result["differences"]:
            click.echo(f"note: {line}")


@main.command("verify")
@click.argument("table", type=click.Path(path_type=Path))
@click.option("--full", is_flag=True, help="Hash every byte (default: 16 random 16 MiB blocks and both ends).")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="With --full: show a progress bar of the bytes hashed on stderr.")
@json_option
@user_errors
def verify(table: Path, full: bool, progress: bool, as_json: bool) -> None:
    """Check TABLE's size and hashes against its sidecar. A mismatch is one line, as `overlay
    verify` prints each of its own ("mismatch: PATH: what differs"), with exit status 3."""
    from flashnext.quant.ple.table import verify_table

    try:
        result = verify_table(table, full=full, progress=progress)
    except VerificationMismatch as e:
        problem = str(e).removeprefix(f"{table}: ")
        if as_json:
            emit_json({"ok": False, "mismatches": [{"path": str(table), "problem": problem}]})
        else:
            click.echo(f"mismatch: {table}: {problem}", err=True)
        raise VerificationMismatch("1 mismatch") from None
    if as_json:
        emit_json(result)
    else:
        click.echo(f"ok: {table} ({result['mode']}, {format_size(result['bytes_checked'])} hashed)")


@main.command("residency")
@click.argument("table", type=click.Path(path_type=Path))
@json_option
@user_errors
def residency(table: Path, as_json: bool) -> None:
    """How much of TABLE is in the page cache (mincore)."""
    from flashnext.quant.ple.prefetch import PAGE_SIZE, TableMapping

    if not table.is_file():
        raise FlashnextError(f"{table}: no such file")
    mapping = TableMapping(table, 1)
    try:
        resident, pages = mapping.residency()
    finally:
        mapping.close()
    result = {"path": str(table), "resident_pages": resident, "pages": pages,
              "resident_bytes": resident * PAGE_SIZE, "fraction": resident / pages if pages else 0.0}
    if as_json:
        emit_json(result)
    else:
        click.echo(f"{table}: {result['fraction'] * 100:.1f}% resident "
                   f"({format_size(resident * PAGE_SIZE)} of {format_size(pages * PAGE_SIZE)})")


@main.command("drive-check")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--seconds", type=click.FloatRange(min=0.5), default=10.0, show_default=True,
              help="How long to measure, split between the QD1 latency half and the throughput half.")
@click.option("--depth", type=click.IntRange(2, 256), default=32, show_default=True,
              help="Reads outstanding in the throughput half.")
@json_option
@user_errors
def drive_check_cmd(path: Path, seconds: float, depth: int, as_json: bool) -> None:
    """O_DIRECT 4 KiB random reads on PATH (a file on the drive, e.g. the table): QD1 latency
    and deep-queue throughput. Exits 4 if the drive's tail would stall decode."""
    from flashnext.quant.ple.drive import drive_check

    result = drive_check(path, seconds, depth)
    if as_json:
        emit_json(result)
    else:
        q, d = result["qd1"], result["deep"]
        click.echo(f"QD1: p50 {q['p50_ms']:.3f} ms, p99 {q['p99_ms']:.3f} ms, max {q['max_ms']:.1f} ms "
                   f"({q['iops']:.0f} IOPS)")
        click.echo(f"QD{d['depth']}: {d['iops']:.0f} IOPS ({d['mb_per_s']:.0f} MB/s)")
        click.echo(result["verdict"])
    if not result["ok"]:
        raise SlowDrive(result["verdict"])
