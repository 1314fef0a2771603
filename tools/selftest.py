"""``flashnext selftest``: check this machine's serving stack on the demo checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from flashnext.tools._common import begin, emit_json, json_option, user_errors


def _gpus(value: str) -> str:
    if value == "auto" or (value.isdigit() and int(value) >= 0):
        return value
    raise click.BadParameter("give auto or a number of GPUs", param_hint="--gpus")


@click.command("selftest")
@click.option("--profile", "profile_name", default="3x3090", show_default=True,
              help="The serving profile whose parallel layout and patches to test.")
# Not file_okay=False: click would refuse an existing file as a usage error (its usage block, exit 2); it is
# bad input, refused in one line (exit 1) as every writer refuses an --out that exists.
@click.option("--out", type=click.Path(path_type=Path), metavar="DIRECTORY", default=Path("flashnext-selftest"),
              show_default=True, help="Output directory: report.json, report.html, runs/ (bench reports, server logs).")
@click.option("--force", is_flag=True, help="Replace --out if an earlier flashnext selftest made it.")
@click.option("--gpus", default="auto", show_default=True, callback=lambda c, p, v: _gpus(v),
              help="How many CUDA GPUs to use: auto (as many as NVML, else nvidia-smi, reports) or N (0: the CPU "
                   "part only).")
@click.option("--keep", is_flag=True, help="Keep the scratch directory (demo checkpoint, patched vLLM tree) and say where.")
@json_option
@user_errors
def main(profile_name: str, out: Path, force: bool, gpus: str, keep: bool, as_json: bool) -> None:
    """Run before loading the 125B model: the patch series against the installed vLLM, the demo
    checkpoint's quantized layers against the GPU kernels vLLM picks for them (capabilities 8.6 and
    9.0), the demo's PLE table as NVFP4 and FP8 overlays read back through vLLM's own PLE module,
    and, on CUDA GPUs with the patched vLLM, the demo served as the profile serves (its pipeline
    size), benched with every patch on and with each patch's switch off, against an A/A rerun, and
    with its PLE table as NVFP4 against BF16. Writes OUT/report.json and OUT/report.html; exits 0
    only if everything that ran passed or agreed (1 otherwise). Without GPUs it runs the CPU part
    and says, per patch, what it could not run; its headline then says PARTIAL and how many of the
    checks ran. `--gpus N` with fewer than N GPUs here is refused before anything runs.
    """
    from flashnext.quant.checkpoint.fsutil import refuse_existing_output
    from flashnext.serving.deployment import resolve_deployment
    from flashnext.serving.selftest import SelftestFailed, selftest
    from flashnext.serving.selftest.report import headline
    from flashnext.serving.selftest.runner import MADE_BY, gpu_count

    refuse_existing_output(out, force, made_by=MADE_BY)  # before minutes of checks, not after
    gpu_count(gpus)  # more GPUs asked for than are here: refused now, not after the CPU part
    begin(f"selftest of {profile_name} into {out}: the patch series, the demo's layers against vLLM's kernels")
    # resolved once: the runner and its GPU part take it, none loads the profile again
    deployment = resolve_deployment(profile_name)
    report, kept = selftest(deployment, out, gpus=gpus, keep=keep, force=force,
                            progress=lambda line: click.echo(line, err=True))
    s = report.summary
    if as_json:
        emit_json({"ok": s.ok, "headline": headline(s), "out": str(out), "passed": s.passed, "failed": s.failed,
                   "could_not_run": s.could_not_run, "lines": s.lines,
                   "patches": {p.id: p.ab for p in report.patches},
                   "ple_formats": {c.format: {"status": c.status, "rows_differing": c.rows_differing,
                                              "relative_mse": c.relative_mse} for c in report.ple_formats.formats},
                   "ple_format_ab": {"format": report.ple_format_ab.format, "status": report.ple_format_ab.status,
                                     "against_floor": report.ple_format_ab.against_floor,
                                     "mean_kl_nats": report.ple_format_ab.agreement.mean_kl_nats
                                     if report.ple_format_ab.agreement else None},
                   "kept": str(kept) if kept else None})
    else:
        for line in s.lines:
            click.echo(line)
        click.echo(f"{headline(s)}; wrote {out}/report.html and report.json")
        if kept:
            click.echo(f"kept the scratch directory {kept}")
    if not s.ok:
        raise SelftestFailed(f"{s.failed} check(s) failed")
