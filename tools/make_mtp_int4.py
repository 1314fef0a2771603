"""``make-mtp-int4``: the MTP draft head's routed experts as an INT4 overlay."""

from __future__ import annotations

import json
from pathlib import Path

import click

from flashnext.errors import FlashnextError, UsageError
from flashnext.quant.quantizers.base import SUPPORTED_GROUP_SIZES, available_quantizers
from flashnext.sizes import format_size
from flashnext.tools._common import CONTEXT_SETTINGS, RootCommand, begin, emit_json, json_option, user_errors


class RegisteredQuantizer(click.Choice):
    """The quantizer registry's names as click choices, read when the command line is parsed (not
    when this module is imported), so that a quantizer registered later can be chosen too."""

    def __init__(self) -> None:
        self.case_sensitive = True

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(available_quantizers())


@click.command("make-mtp-int4", cls=RootCommand, context_settings=CONTEXT_SETTINGS)
@click.option("--src", type=click.Path(path_type=Path), required=True,
              help="The downloaded snapshot (config.json, model.safetensors.index.json, shards). Never modified.")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="The overlay directory to create (built beside it, renamed into place at the end).")
@click.option("--group-size", type=click.Choice([str(g) for g in SUPPORTED_GROUP_SIZES]), default="128",
              show_default=True,
              help="Weights per scale along the input dimension.")
@click.option("--positive-scales", is_flag=True,
              help="Keep every scale positive (by default a scale may be negative so that code -8 "
                   "lands on the larger-magnitude side).")
@click.option("--quantizer", type=RegisteredQuantizer(), default=None,
              help="The registered quantizer (quant/quantizers/base.py): mse, the MSE scale search (the default); "
                   "rtn, plain absmax RTN, for A/B comparisons; gptq, the searched scales with codes chosen "
                   "against each expert's routed Gram matrix (needs --calib); or one of your own.")
# The flags that came before --quantizer, kept for the command lines that use them: each is one
# quantizer (LEGACY_QUANTIZER_FLAGS).
@click.option("--scale-search/--no-scale-search", default=None, hidden=True)
@click.option("--rounding", type=click.Choice(["nearest", "gptq"]), default=None, hidden=True)
@click.option("--calib", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Calibration activations: a safetensors file with hidden_states [tokens, hidden] at the MTP "
                   "MoE block's input. Each expert's scales then minimise the output error on the tokens its "
                   "router sends it (docs/make-mtp-int4.md says how to capture them). Without it: weight-only.")
@click.option("--calib-min-tokens", type=click.IntRange(1), default=32, show_default=True,
              help="An expert routed fewer calibration tokens is topped up with the all-token average.")
@click.option("--gptq-prior-tokens", type=click.IntRange(0), default=640, show_default=True,
              help="With --quantizer gptq: add this many tokens' worth of the all-token Gram matrix to each "
                   "expert's, so that codes fit the expert's inputs rather than its few calibration tokens.")
@click.option("--device", default="cpu", show_default=True,
              help="Where to quantize: cpu, cuda, cuda:N.")
@click.option("--experts-per-batch", type=click.IntRange(1), default=None,
              help="Experts in flight at once (default 4 on the CPU, 32 on a GPU); ~0.11 GiB each at full size.")
@click.option("--force", is_flag=True, help="Replace an existing --out (only once the new overlay is complete).")
@click.option("--report", type=click.Path(path_type=Path), default=None,
              help="Also write the quantization report as JSON to this file.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
@json_option
@user_errors
def main(src: Path, out: Path, group_size: str, quantizer: str | None, positive_scales: bool,
         scale_search: bool | None, rounding: str | None, calib: Path | None,
         calib_min_tokens: int, gptq_prior_tokens: int, device: str,
         experts_per_batch: int | None, force: bool, report: Path | None, progress: bool,
         as_json: bool) -> None:
    """Quantize the MTP routed experts of SRC to symmetric INT4 (MSE-searched scales by default) and write
    an overlay OUT: the rewritten shard(s), index, config.json and overlay.json.

    \b
    Example:
      make-mtp-int4 --src ~/models/Qwen3.8-Flash-Next --out ~/overlays/mtp-int4
    """
    from flashnext.quant.checkpoint.fsutil import refuse_existing_output
    from flashnext.quant.overlays.mtp_int4 import MtpInt4Builder, MtpInt4Options, make_mtp_int4
    from flashnext.quant.quantizers.device import DeviceError

    # The options and the outputs are checked before the work imports torch (seconds).
    quantizer = one_quantizer(quantizer, {"--scale-search": scale_search, "--rounding": rounding})
    options = MtpInt4Options(group_size=int(group_size), positive_scales=positive_scales, device=device,
                             experts_per_batch=experts_per_batch, calib=calib, calib_min_tokens=calib_min_tokens,
                             gptq_prior_tokens=gptq_prior_tokens,
                             **({"quantizer": quantizer} if quantizer is not None else {}))
    refuse_existing_output(out, force, {"the source snapshot": src, "--calib": calib},
                           made_by=MtpInt4Builder.tool)
    if report is not None:
        _check_report_path(report, src, out)
    begin(f"quantizing the MTP experts of {src} to INT4 into {out} (torch loads first)")
    try:
        result = make_mtp_int4(src, out, options, force=force, progress=progress)
    except DeviceError as e:
        raise FlashnextError(f"--device {e.name!r}{e.problem}") from None
    if report is not None:
        _write_report(report, result, {"the source snapshot": src, "--out": out})
    if as_json:
        emit_json(result)
        return
    click.echo(f"wrote {out} ({format_size(result['bytes_written'])}) in {result['seconds']:.1f} s, "
               f"{result['mode']}")
    for proj, s in result["projections"].items():
        ratio = s["ratio_to_absmax_rtn"]
        click.echo(f"  {proj:4s} x{s['matrices']}: rel MSE {s['rel_mse']:.4e}"
                   + (f" ({ratio:.3f}x absmax RTN)" if ratio else "")
                   + (f"; output rel MSE {s['output_rel_mse']:.4e} (weight-only {s['weight_only_output_rel_mse']:.4e})"
                      if "output_rel_mse" in s else ""))


# What each older flag says about the quantizer: the one it chooses, or the one it rules out.
LEGACY_QUANTIZER_FLAGS: dict[tuple[str, object], tuple[str, bool]] = {
    ("--scale-search", False): ("rtn", True),     # --no-scale-search is --quantizer rtn
    ("--scale-search", True): ("rtn", False),     # a searched scale: anything but rtn
    ("--rounding", "gptq"): ("gptq", True),       # --rounding gptq is --quantizer gptq
    ("--rounding", "nearest"): ("gptq", False),   # nearest rounding: anything but gptq
}


def one_quantizer(quantizer: str | None, legacy: dict[str, object]) -> str | None:
    """The one quantizer that ``--quantizer`` and the older flags given (``legacy``: flag -> value,
    None where not given) choose; None where none chooses (the library's default). Flags that
    disagree are one line, a usage error."""
    said = [(f"--quantizer {quantizer}", quantizer, True)] if quantizer is not None else []
    for flag, value in legacy.items():
        if value is not None:
            name, chosen = LEGACY_QUANTIZER_FLAGS[flag, value]
            shown = f"{flag} {value}" if isinstance(value, str) else flag if value else f"--no-{flag[2:]}"
            said.append((shown, name, chosen))
    chosen = {name for _, name, yes in said if yes}
    ruled_out = {name for _, name, yes in said if not yes}
    if len(chosen) > 1 or chosen & ruled_out:
        raise UsageError(f"{' and '.join(s for s, _, _ in said)} choose different quantizers: give one --quantizer")
    return next(iter(chosen), None)


def _check_report_path(report: Path, src: Path, out: Path) -> None:
    """``--report`` may not write into the source or the overlay, nor where no file can be written, nor
    replace a file that is not an earlier report (checked before the work starts, so a bad path costs
    nothing)."""
    from flashnext.quant.checkpoint.fsutil import check_file_destination
    from flashnext.quant.records.jsonfile import read_json

    check_file_destination(report, "report", {"the source snapshot": src, "--out": out})
    if report.exists() or report.is_symlink():
        try:
            earlier = read_json(report, "a make-mtp-int4 report")
        except FlashnextError:
            earlier = {}
        if earlier.get("tool") != "make-mtp-int4":
            raise FlashnextError(f"--report {report} exists and is not a make-mtp-int4 report; "
                                 "choose another file")


def _write_report(report: Path, result: dict, inputs: dict[str, Path | None]) -> None:
    """Write ``--report``; it may not be, contain or lie inside ``inputs`` as opened when written."""
    from flashnext.quant.checkpoint.fsutil import make_parents, write_text_atomic

    make_parents(report)
    write_text_atomic(report, json.dumps(result, indent=2) + "\n", inputs=inputs)


if __name__ == "__main__":
    main()
