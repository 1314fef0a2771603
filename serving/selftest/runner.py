"""``flashnext selftest``: what runs, in order, and the verdict.

CPU part (always): the patch series against the installed vLLM (``patch_series.check_series``:
zero fuzz on a shadow copy, compiled, probed), the kernel fit (:mod:`.kernel_fit`, vLLM's own
model built on the CPU from the demo config, in the patched tree, at capabilities 8.6 and 9.0) and
the PLE formats (:mod:`.ple_formats`: the demo's table as NVFP4 and FP8 overlays, read back through
vLLM's own PLE module in the same interpreter as the kernel fit).
GPU part (CUDA GPUs for the profile's pipeline and a patched vLLM installed): :mod:`.gpu`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

from flashnext import __version__
from flashnext.errors import FlashnextError, named
from flashnext.serving import vllm_release
from flashnext.serving.selftest.report import (
    KernelChoice, KernelChoices, KernelFit, KernelLayer, Machine, PatchResult, PleFormatAB, PleFormats, RunResult,
    SelftestReport, SeriesCheck, Summary,
)

MADE_BY = "flashnext selftest"  # its --out's marker, and its scratch directory's

# Patches whose code runs on the quantized layers the kernel fit checks: decode-05 hands the routed
# experts to vLLM's Marlin MoE; int6-bitplane's switch off serves INT6 through vLLM's own kernel.
KERNEL_FIT_PATCHES = {"decode-05", "int6-bitplane"}


class SelftestFailed(FlashnextError):
    """Something that ran failed or disagreed (each was printed and is in the report)."""

    printed = True


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _cpu_env(pythonpath: Path | None = None) -> dict[str, str]:
    """A fresh interpreter that sees no GPU: vLLM picks its CPU platform, Triton its interpreter."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1", VLLM_TARGET_DEVICE="cpu",
               PYTHONDONTWRITEBYTECODE="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *sys.path[1:]])
    return env


# -- the series --------------------------------------------------------------------------------

def check_series(patches) -> SeriesCheck:
    from flashnext.serving import patch_series

    try:
        results = patch_series.check_series()
    except FlashnextError as e:
        return SeriesCheck(status="failed", detail=str(e), patches=[])
    return SeriesCheck(status="passed", detail=f"{len(results)} patches applied with zero fuzz, compiled and probed",
                       patches=[r["id"] for r in results])


def installed_vllm_is_patched() -> tuple[bool, str | None]:
    """Whether every probe passes against the installed vLLM; else the first failing patch and why."""
    from flashnext.serving import patch_series

    try:
        failures = patch_series.probe_tree()
    except FlashnextError as e:
        return False, f"the probes did not run: {e}"
    if not failures:
        return True, None
    (first, why), *others = failures.items()
    return False, f"{first} ({why[:200]})" + (f" and {len(others)} more" if others else "")


# -- the kernel fit ----------------------------------------------------------------------------

def check_kernel_choices(device: str = "cuda:0", timer=None) -> KernelChoices:
    """The launch table's decisions timed both ways on ``device`` (:mod:`flashnext.quant.kernels.choices`);
    a pick slower than its alternative is advice (the row to add), not a failure."""
    import torch

    from flashnext.quant.kernels import choices

    dev = torch.device(device)
    try:
        points = choices.time_choices(dev, **({"timer": timer} if timer else {}))
    except Exception as error:  # a kernel that fails to compile or launch on this GPU is what this step finds
        return KernelChoices(status="failed", detail=f"{type(error).__name__}: {str(error)[:300]}", device=None,
                             points=[])
    rows = [KernelChoice(**choices.as_dict(p)) for p in points]
    slower = [choices.advice(p) for p in points if not p.agrees]
    detail = f"{len(points) - len(slower)} of {len(points)} picks are the fastest here"
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    return KernelChoices(status="passed", detail="; ".join([detail, *slower]), device=name, points=rows)


def check_kernel_fit(config: dict, workdir: Path, tree: Path | None) -> KernelFit:
    """vLLM's kernel choice and the Marlin / Humming rules for every quantized layer of the model
    ``config`` (a config.json dict), at 8.6 and 9.0; ``tree``: the patched vLLM to build it with."""
    return check_in_vllm(config, workdir, tree)[0]


def check_in_vllm(config: dict, workdir: Path, tree: Path | None, snapshot=None,
                  built: dict | None = None) -> tuple[KernelFit, PleFormats | None]:
    """The kernel fit (:func:`check_kernel_fit`) and, given the PLE overlays ``built`` from
    ``snapshot`` (the demo, a :class:`~flashnext.quant.checkpoint.snapshot.Snapshot`:
    :func:`.ple_formats.build_views`), their read-back through vLLM's own PLE module: one fresh vLLM
    interpreter for both, so that vLLM's import (10-20 s) is paid once."""
    from flashnext.serving.selftest import ple_formats
    from flashnext.serving.selftest.kernel_fit import CAPABILITIES, STAND_IN

    model_dir = workdir / "kernel-fit-config"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    out = workdir / "kernel-fit.json"
    argv = [sys.executable, "-m", "flashnext.serving.selftest.kernel_fit", str(model_dir), str(out)]
    if built is not None:
        ple_dir = workdir / "ple-read-back"
        ple_dir.mkdir(parents=True, exist_ok=True)
        request, ple_out = ple_dir / "request.json", ple_dir / "result.json"
        request.write_text(json.dumps({"snapshot": str(snapshot.root),
                                       "views": {fmt: b["view"] for fmt, b in built.items() if "view" in b}}))
        argv += [str(request), str(ple_out)]
    done = subprocess.run(argv, capture_output=True, text=True, env=_cpu_env(tree), timeout=1200)
    tail = [x for x in done.stderr.strip().splitlines() if x.strip() and not x.startswith(("INFO", "WARNING"))]
    last = (tail or ["no output"])[-1][:400]
    ple = None
    if built is not None:
        read, why = None, None
        if ple_out.is_file():
            result = json.loads(ple_out.read_text())
            read, why = result.get("formats"), result.get("error")
        else:
            why = f"the vLLM interpreter stopped before the read-back: {last}"
        ple = ple_formats.judge(snapshot, built, read, why)
    return _kernel_fit(done, out, last, CAPABILITIES, STAND_IN), ple


def _kernel_fit(done, out: Path, last: str, capabilities, stand_in: str) -> KernelFit:
    """The kernel fit's record from the interpreter's exit (``done``), its output ``out`` and the
    last line it printed to stderr (``last``)."""
    caps = list(capabilities)
    if done.returncode != 0 or not out.is_file():
        return KernelFit(status="failed", detail=f"the kernel-fit build failed: {last}",
                         capabilities=caps, layers=[], stand_in=stand_in)
    result = json.loads(out.read_text())
    layers = [KernelLayer(**{k: v for k, v in row.items() if k != "fits"}) for row in result["layers"]]
    misfits = [row for row in result["layers"] if not row["fits"]]
    problems = list(result["errors"]) + [
        f"{row['layer']} ({row['weight_type']} g{row['group_size']}, K={row['k']}) at {row['capability'] / 10:.1f}: "
        f"{'; '.join(row['reasons'])} (vLLM picks {row['kernel']})" for row in misfits]
    if problems:
        return KernelFit(status="failed", detail=f"{len(problems)} problem(s): {problems[0]}" +
                         (f" (and {len(problems) - 1} more in the report)" if len(problems) > 1 else ""),
                         capabilities=caps, layers=layers, stand_in=stand_in)
    kinds = sorted({row.kernel for row in layers})
    n = len({row.layer for row in layers})
    return KernelFit(status="passed", detail=f"{n} quantized layers fit at {', '.join(f'{c / 10:.1f}' for c in caps)}: "
                     f"{', '.join(kinds)}", capabilities=caps, layers=layers, stand_in=stand_in)


# -- the whole run -----------------------------------------------------------------------------

def _failing_patch(detail: str) -> str | None:
    m = re.match(r"patch (\S+) ", detail)
    return m.group(1) if m else None


def gpu_count(gpus: str) -> tuple[int, list[str]]:
    """How many GPUs the selftest uses, and their names: all that are visible (``auto``) or the
    ``gpus`` asked for, refused when fewer are visible (before minutes of CPU checks, not after)."""
    from flashnext.serving.preflight import visible_gpus

    devices = visible_gpus()
    names = [d.name for d in devices]
    if gpus == "auto":
        return len(devices), names
    if int(gpus) > len(devices):
        raise FlashnextError(f"{gpus}: {len(devices)} GPU(s) visible here (NVML, nvidia-smi); "
                             f"pass {named('gpus')} auto, or {named('gpus')} 0 for the CPU part only", field="gpus")
    return int(gpus), names[: int(gpus)]


def run_selftest(deployment, out_tmp: Path, workdir: Path, gpus: str = "auto",
                 progress: Callable[[str], None] = lambda line: None, launcher=None,
                 config: dict | None = None) -> SelftestReport:
    """Every part this machine can run for ``deployment`` (a
    :class:`~flashnext.serving.deployment.Deployment` of the profile to test, resolved by the command;
    the model it serves is the demo checkpoint written here), results written under ``out_tmp`` (the
    output being built), scratch (the demo checkpoint, the patched tree) under ``workdir``.
    ``config``: the demo's config.json to check instead of ``flashnext.quant.demo``'s; ``launcher``:
    how ``vllm serve`` starts (:class:`.gpu.Launcher`)."""
    import dataclasses

    from flashnext.quant import demo
    from flashnext.serving import patch_series
    from flashnext.serving.patch_series import load_series
    from flashnext.serving.selftest import gpu, ple_formats

    started = _now()
    profile = deployment.profile
    profile_name = profile.name
    if profile.model_family != "qwen4_exp":
        raise FlashnextError(f"profile {profile_name} serves {profile.model_family}; the selftest's demo checkpoint "
                             "is a qwen4_exp model: choose a qwen4_exp profile")
    version = vllm_release.installed_version()
    if version is None:
        raise FlashnextError(f"flashnext selftest runs vLLM's own code: {vllm_release.support_line(None)}")
    progress(vllm_release.support_line(version))
    patches = load_series()
    config = config if config is not None else demo.demo_config()
    n_gpus, names = gpu_count(gpus)
    pp = gpu.pipeline_size(profile)

    progress("[cpu 1/3] the patch series against the installed vLLM (zero fuzz, compile, probes)")
    series = check_series(patches)
    progress(f"          {series.status}: {series.detail}")
    tree = patch_series.patched_tree(workdir / "patched-vllm") if series.status == "passed" else None
    progress("[cpu 2/3] PLE formats: the demo's PLE table built as NVFP4 and FP8 overlays")
    snapshot = workdir / "demo"
    demo.write_demo_checkpoint(snapshot)
    # the profile, as resolved, serving the demo (with its table file where the profile serves one):
    # what the rest of the selftest takes, the demo opened once
    demo_deployment = dataclasses.replace(deployment, model=snapshot, overlays=(),
                                          ple_table=workdir / "ple-table.bin" if profile.uses_ple_table else None)
    built = ple_formats.build_views(demo_deployment.snapshot, workdir / "ple-formats")
    progress("[cpu 3/3] in vLLM's own code on the CPU: kernel fit (the demo's quantized layers at 8.6 and 9.0) "
             "and the PLE overlays read back by Qwen4ExpNGramEmbedding")
    fit, ple = check_in_vllm(config, workdir, tree, demo_deployment.snapshot, built)
    if tree is None:
        fit.detail += " (built with the installed vLLM: the series did not apply)"
        ple.detail += " (read with the installed vLLM: the series did not apply)"
    progress(f"          kernel fit {fit.status}: {fit.detail}")
    progress(f"          PLE formats {ple.status}: {ple.detail}")

    choices = None
    if n_gpus:
        progress("[gpu] kernel choices: the launch table's picks timed against their alternatives")
        choices = check_kernel_choices()
        progress(f"      {choices.status}: {choices.detail}")
    patched, unpatched = None, None
    if n_gpus:
        patched, unpatched = installed_vllm_is_patched()
    if n_gpus < pp:
        gpu_status, gpu_detail = "could_not_run", (
            "--gpus 0: the CPU part only" if gpus == "0" else "no CUDA GPU here" if n_gpus == 0
            else f"profile {profile_name} runs PP={pp}, and {n_gpus} GPU(s) are here")
    elif not patched:
        gpu_status, gpu_detail = "could_not_run", (f"the installed vLLM is not the patched one (probe of {unpatched} "
                                                   "fails): run inside the flashnext image")
    else:
        gpu_status, gpu_detail = "passed", ""
    argv = gpu.vllm_serve_argv(workdir / "demo", profile, 8000)
    runs: list[RunResult] = []
    part = None
    if gpu_status == "passed":
        from flashnext.quant.overlays.view import OverlayStack, apply_overlays
        from flashnext.quant.ple.table import build_table
        from flashnext.serving.selftest.tokenizer import write_tokenizer

        progress("[gpu] writing the demo's tokenizer, its PLE table and a view of its NVFP4 PLE overlay")
        write_tokenizer(snapshot)
        if demo_deployment.ple_table is not None:
            build_table(snapshot, demo_deployment.ple_table, progress=False)
        # A view made now holds the tokenizer too (`flashnext overlay apply`'s machinery, as `serve --overlay`).
        nvfp4_view = None
        if "overlay" in built["nvfp4"]:
            nvfp4_view = workdir / "demo-ple-nvfp4"
            overlay = Path(built["nvfp4"]["overlay"])
            apply_overlays(snapshot, [overlay], nvfp4_view,
                           stack=OverlayStack(snapshot, [overlay], open_base=lambda: demo_deployment.snapshot))
        part = gpu.run_gpu_part(demo_deployment, patches, launcher or gpu.Launcher(), out_tmp / "runs", out_tmp,
                                progress, ple_view=nvfp4_view)
        runs = [r.result for r in part.runs]
        failed_runs = [r for r in runs if r.name in ("on", "on-again") and r.error]
        if failed_runs:
            gpu_status, gpu_detail = "failed", f"run {failed_runs[0].name}: {failed_runs[0].error}"
        else:
            gpu_detail = f"{len(runs)} server starts on {n_gpus} GPU(s)"

    results = patch_results(patches, series, fit, part, gpu_detail)
    if part is not None and part.ple_ab is not None:
        ple_ab = part.ple_ab
    else:
        why = (f"the A/B needs the GPU part: {gpu_detail}" if part is None
               else f"the NVFP4 overlay was not built: {built['nvfp4'].get('error')}")
        ple_ab = PleFormatAB(format="nvfp4", status="could_not_run", against_floor="could_not_run", detail=why,
                             run=None, agreement=None, decode_change_pct=None)
    machine = Machine(cuda_gpus=n_gpus, gpu_names=names, vllm_version=version, vllm_patched=patched,
                      unpatched_probe=unpatched)
    report = SelftestReport(
        flashnext_version=__version__, started_at=started, finished_at=_now(), profile=profile_name, machine=machine,
        series=series, kernel_fit=fit, ple_formats=ple, gpu_part=gpu_status, gpu_detail=gpu_detail, vllm_command=argv,
        kernel_choices=choices,
        thresholds=gpu.THRESHOLDS, runs=runs, noise_floor=part.noise_floor if part else None, patches=results,
        ple_format_ab=ple_ab, summary=Summary(ok=True, passed=0, failed=0, could_not_run=0, lines=[]))
    report.summary = summarize(report)
    return report


def patch_results(patches, series: SeriesCheck, fit: KernelFit, part, gpu_detail: str) -> list[PatchResult]:
    """Per patch: its probe, the kernel fit where it applies, and its A/B (or why it could not run)."""
    failing = _failing_patch(series.detail) if series.status == "failed" else None
    results = []
    for p in patches:
        probe = "passed" if series.status == "passed" else ("failed" if p.id == failing else "could_not_run")
        if part is not None:
            verdict, detail, agreement, change = part.verdicts[p.id]
        else:
            verdict, detail, agreement, change = "could_not_run", f"the A/B needs the GPU part: {gpu_detail}", None, None
        results.append(PatchResult(id=p.id, env_switch=p.env_switch, probe=probe,
                                   kernel_fit=fit.status if p.id in KERNEL_FIT_PATCHES else None, ab=verdict,
                                   ab_detail=detail, agreement=agreement, decode_change_pct=change))
    return results


def summarize(r: SelftestReport) -> Summary:
    """Counts over the checks that stand alone: the series, the kernel fit, the PLE formats, the GPU
    part, each A/B (the PLE table as NVFP4 counts as failed only when it could not be served: its
    difference from BF16 is the format's, and is reported)."""
    passed = failed = cnr = 0
    lines = []
    for name, status, detail in (("series", r.series.status, r.series.detail),
                                 ("kernel fit", r.kernel_fit.status, r.kernel_fit.detail),
                                 ("PLE formats", r.ple_formats.status, r.ple_formats.detail),
                                 ("GPU part", r.gpu_part, r.gpu_detail)):
        if status == "passed":
            passed += 1
        elif status == "failed":
            failed += 1
            lines.append(f"FAILED {name}: {detail}")
        else:
            cnr += 1
            lines.append(f"could not run {name}: {detail}")
    for p in r.patches:
        if p.ab == "agree":
            passed += 1
        elif p.ab == "disagree":
            failed += 1
            lines.append(f"DISAGREES {p.id} ({p.env_switch} against on): {p.ab_detail}")
        else:
            cnr += 1
            if r.gpu_part == "passed":
                lines.append(f"could not run {p.id} off: {p.ab_detail}")
    ab = r.ple_format_ab
    if ab.status == "passed":
        passed += 1
        lines.append(f"PLE table as NVFP4 against BF16 on the demo ({_PLE_AB_MARK[ab.against_floor]}): {ab.detail}. "
                     "The demo's numbers, not the real model's: run docs/ple.md's A/B on it")
    elif ab.status == "failed":
        failed += 1
        lines.append(f"FAILED the PLE table as NVFP4: {ab.detail}")
    else:
        cnr += 1
        if r.gpu_part == "passed":
            lines.append(f"could not run the PLE table as NVFP4: {ab.detail}")
    if r.gpu_part != "passed":
        lines.append(f"could not run the A/B of {len(r.patches)} patches and of the PLE table as NVFP4 against BF16: "
                     f"{r.gpu_detail}")
    if r.kernel_choices is not None:
        c = r.kernel_choices
        if c.status == "failed":
            failed += 1
            lines.append(f"FAILED kernel choices: {c.detail}")
        else:
            passed += 1
            lines.extend(f"kernel choice: {line}" for line in c.detail.split("; ")[1:])
    return Summary(ok=failed == 0, passed=passed, failed=failed, could_not_run=cnr, lines=lines)


_PLE_AB_MARK = {"agree": "within the A/A floor", "disagree": "beyond the A/A floor", "could_not_run": "no comparison"}


def write_outputs(report: SelftestReport, out_tmp: Path) -> list[str]:
    from flashnext.serving.selftest.html import write_html

    (out_tmp / "report.json").write_text(json.dumps(report.model_dump(mode="json"), indent=1) + "\n")
    write_html(report, out_tmp / "report.html")
    return ["report.json", "report.html"]


def selftest(deployment, out: Path, gpus: str = "auto", keep: bool = False, force: bool = False,
             progress: Callable[[str], None] = lambda line: None, launcher=None,
             config: dict | None = None) -> tuple[SelftestReport, Path | None]:
    """:func:`run_selftest` of ``deployment`` into ``out`` (whole or not at all); with ``keep`` the
    scratch directory stays, and is returned."""
    from flashnext.quant.checkpoint.fsutil import atomic_directory, scratch_directory

    with scratch_directory("selftest", MADE_BY, keep=keep) as workdir, \
            atomic_directory(Path(out), force=force, made_by=MADE_BY) as tmp:
        report = run_selftest(deployment, tmp, workdir, gpus, progress, launcher, config)
        write_outputs(report, tmp)
    return report, workdir if keep else None
