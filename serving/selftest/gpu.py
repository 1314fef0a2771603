"""The GPU part: the demo checkpoint served by the patched vLLM, benched with every patch on, again
with each patch's switch off, and once more with all on (the A/A noise floor); then, with every patch
on, served with its PLE table as NVFP4 (a view of the overlay the CPU part built) against the BF16
table of the first run.

Every run is a fresh ``vllm serve`` process (a switch is read at startup), started through a
:class:`Launcher`, the one place a test replaces: it gets the exact command line and environment.
The bench is :class:`flashnext.serving.bench.Bench` called as a library, each off-run compared with
the first on-run as ``flashnext bench --baseline`` compares.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.serving.selftest.report import Agreement, PleFormatAB, RunResult, Thresholds

SERVED_MODEL = "flashnext-selftest-demo"
# The demo is 10 MB: a short context and a small KV budget start fast and leave the GPUs to the user.
DEMO_MAX_MODEL_LEN = 4096
DEMO_KV_CACHE_BYTES = 256 * 2**20
# Arguments of the 125B profile that do not apply to a text-only 10 MB model (with their values).
_DROPPED_ARGS = {"--max-model-len": 1, "--kv-cache-memory-bytes": 1, "--limit-mm-per-prompt": 1,
                 "--mm-processor-kwargs": 1, "--gpu-memory-utilization": 1}
THRESHOLDS = Thresholds(matching_slack=0.02, kl_factor=4.0, kl_abs_nats=1e-3)


@dataclass(frozen=True)
class Switch:
    patch: str
    name: str
    off: str
    on: str

    @property
    def line(self) -> str:
        return f"{self.name}={self.off}"


def switches(patches, profile_env: dict[str, str], ple_table: Path | None) -> list[Switch]:
    """Each patch's switch with its off value and the value that turns it on here: the
    profile's, the PLE table for ple-mmap, else flashnext's default when that is on, else 1."""
    out = []
    for p in patches:
        name = p.switch.name
        if name in profile_env:
            on = profile_env[name]
        elif p.switch is envs.VLLM_PLE_MMAP_PATH:
            on = str(ple_table) if ple_table else ""
        elif p.switch.enabled_in({}):
            on = p.switch.default
        else:
            on = "1"
        out.append(Switch(p.id, name, p.switch_off, on))
    return out


def pipeline_size(profile) -> int:
    """``--pipeline-parallel-size`` (or ``-pp``) as vLLM's parser reads it: either spelling, with
    the value after ``=`` or as the next argument, the last occurrence winning; 1 when absent. Read
    here rather than through ``capacity.shape.engine_args``, which points vLLM at the CPU in this
    process's environment, which the selftest's ``vllm serve`` inherits."""
    size, args = 1, list(profile.vllm_args)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in ("--pipeline-parallel-size", "-pp"):
            size = int(value if eq else args[i + 1])
    return size


def demo_args(profile) -> list[str]:
    """The profile's vLLM arguments scaled to the demo checkpoint: the same parallel layout,
    scheduler and cache modes; no 262k context, images or 125B-sized budgets."""
    out, args, i = [], list(profile.vllm_args), 0
    while i < len(args):
        if args[i] in _DROPPED_ARGS:
            i += 1 + _DROPPED_ARGS[args[i]]
            continue
        out.append(args[i])
        i += 1
    return [*out, "--max-model-len", str(DEMO_MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(DEMO_KV_CACHE_BYTES),
            "--language-model-only", "--served-model-name", SERVED_MODEL]


def vllm_serve_argv(model: Path, profile, port: int) -> list[str]:
    return ["vllm", "serve", str(model), *demo_args(profile), "--host", "127.0.0.1", "--port", str(port)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    """Starts ``vllm serve`` (its own session, so its workers go with it) and stops it."""

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        with open(log, "w") as f:
            try:
                return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                        start_new_session=True)
            except FileNotFoundError:
                from flashnext.serving import vllm_release

                raise FlashnextError(f"{argv[0]} is not on PATH: run from the environment vLLM is installed in, "
                                     f"or install it there: {vllm_release.INSTALL}") from None

    def stop(self, proc: subprocess.Popen, grace_s: float = 60.0) -> None:
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _last_line(log: Path) -> str:
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "no log"
    errors = [x for x in lines if "Error" in x or "error" in x]
    return (errors or lines or ["no output"])[-1][:300]


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, log: Path) -> str | None:
    """None once /health and /v1/models answer; else why not (the server exited, or the time ran out)."""
    deadline = time.monotonic() + timeout_s
    for path in ("/health", "/v1/models"):
        while True:
            if proc.poll() is not None:
                return f"the server exited with status {proc.returncode}: {_last_line(log)}"
            try:
                with urllib.request.urlopen(url + path, timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                return f"{url}{path} did not answer within {timeout_s:.0f} s: {_last_line(log)}"
            time.sleep(0.5)
    return None


def bench_settings():
    """A short bench: one prompt length for TTFT/ITL, decode at 1 and 2 concurrent, logprobs on;
    two measured rounds so that the bench's own round-to-round floor exists too."""
    from flashnext.serving.bench import Settings

    return Settings(prompt_tokens=[128], concurrency=[1], decode_concurrency=[1, 2], decode_tokens=32,
                    ttft_max_tokens=8, warmup=1, repeats=2, needle_tokens=[64], needle_depths=[0.5],
                    needle_concurrency=1, needle_max_tokens=8, structured_requests=1, structured_concurrency=1,
                    structured_max_tokens=64, structured_format="json_schema", top_logprobs=5, seed=0,
                    request_timeout_s=300.0, stall_timeout_s=120.0, phases=["latency", "decode"], extra_body={})


@dataclass
class GpuRun:
    result: RunResult
    report: object | None = None  # the BenchReport


@dataclass
class GpuPart:
    runs: list[GpuRun] = field(default_factory=list)
    noise_floor: Agreement | None = None
    # patch id -> (verdict, detail, agreement, decode change %)
    verdicts: dict[str, tuple[str, str, Agreement | None, float | None]] = field(default_factory=dict)
    ple_ab: PleFormatAB | None = None  # None: not asked (no NVFP4 view was given)


def _agreement(summary) -> Agreement | None:
    if summary is None:
        return None
    return Agreement(by=summary.by, answers=summary.answers, identical=summary.identical,
                     matching_fraction=summary.matching_fraction, mean_kl_nats=summary.mean_kl_nats)


def _decode_tok_s(report) -> float | None:
    points = [d for d in report.endpoints[0].decode if d.concurrency == 1 and d.aggregate_tok_s]
    return points[0].aggregate_tok_s.p50 if points else None


def _itl_p50(report) -> float | None:
    from flashnext.serving.bench import metrics

    samples = report.endpoints[0].itl_samples_s
    return metrics.percentile(samples, 50) if samples else None


def serve_and_bench(launcher: Launcher, name: str, argv_for_port: Callable[[int], list[str]], env: dict[str, str],
                    changed: dict[str, str], runs_dir: Path, out_root: Path, baseline, ready_timeout_s: float) -> GpuRun:
    """One server start, the short bench against it, the server stopped; failures are the result."""
    from flashnext.serving.bench import Bench

    port = free_port()
    slug = name.replace(":", "-")
    log = runs_dir / f"{slug}.log"
    proc = launcher.start(argv_for_port(port), env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        why = wait_ready(proc, url, ready_timeout_s, log)
        if why is not None:
            return GpuRun(RunResult(name=name, env=changed, started=False, error=why, bench_report=None,
                                    decode_tok_s=None, itl_p50_s=None))
        try:
            report = Bench(bench_settings(), [url], models=[SERVED_MODEL, None], baseline=baseline).run()
        except FlashnextError as e:
            return GpuRun(RunResult(name=name, env=changed, started=True, error=f"bench: {e}", bench_report=None,
                                    decode_tok_s=None, itl_p50_s=None))
    finally:
        launcher.stop(proc)
    path = runs_dir / f"{slug}.json"
    path.write_text(json.dumps(report.model_dump(mode="json"), indent=1) + "\n")
    failed = sum(report.endpoints[0].errors.values())
    error = f"{failed} of {report.endpoints[0].requests} bench requests failed" if failed else None
    return GpuRun(RunResult(name=name, env=changed, started=True, error=error,
                            bench_report=str(path.relative_to(out_root)), decode_tok_s=_decode_tok_s(report),
                            itl_p50_s=_itl_p50(report)), report)


def verdict(agreement: Agreement | None, floor: Agreement | None, t: Thresholds = THRESHOLDS) -> tuple[str, str]:
    """agree / disagree against the A/A floor, with the numbers."""
    if agreement is None or agreement.answers == 0:
        return "could_not_run", "no answers to compare"
    if floor is None:
        return "could_not_run", "no A/A noise floor (the rerun with every patch on failed)"
    need = floor.matching_fraction - t.matching_slack
    text = (f"{agreement.identical}/{agreement.answers} identical, {agreement.matching_fraction:.3f} of "
            f"{agreement.by} match (A/A {floor.matching_fraction:.3f})")
    ok = agreement.matching_fraction >= need
    if agreement.mean_kl_nats is not None:
        limit = max(t.kl_factor * (floor.mean_kl_nats or 0.0), t.kl_abs_nats)
        text += f", mean KL {agreement.mean_kl_nats:.3g} nats (limit {limit:.3g})"
        ok = ok and agreement.mean_kl_nats <= limit
    return ("agree" if ok else "disagree"), text


def _change_pct(run: GpuRun, against: GpuRun) -> float | None:
    if against.result.decode_tok_s and run.result.decode_tok_s:
        return (run.result.decode_tok_s - against.result.decode_tok_s) / against.result.decode_tok_s * 100
    return None


def ple_format_ab(launcher: Launcher, profile, ple_view: Path, base_env: dict[str, str], on: GpuRun,
                  floor: Agreement | None, runs_dir: Path, out_root: Path,
                  ready_timeout_s: float) -> tuple[GpuRun, PleFormatAB]:
    """The demo served from ``ple_view`` (its PLE table as NVFP4, every patch on) and benched against
    ``on`` (the BF16 table), as ``flashnext bench --baseline`` compares. No ``VLLM_PLE_MMAP_PATH``:
    vLLM's own NVFP4 method serves the table, as ``serve --overlay`` runs it."""
    changed = {envs.VLLM_PLE_MMAP_PATH.name: ""}
    run = serve_and_bench(launcher, "ple:nvfp4", lambda port: vllm_serve_argv(ple_view, profile, port),
                          {**base_env, **changed}, changed, runs_dir, out_root, on.report, ready_timeout_s)
    if run.report is None:
        return run, PleFormatAB(format="nvfp4", status="failed", against_floor="could_not_run",
                                detail=f"the demo did not serve with its PLE table as NVFP4: {run.result.error}",
                                run=run.result.name, agreement=None, decode_change_pct=None)
    agreement = _agreement(run.report.ab.agreement if run.report.ab else None)
    against, detail = verdict(agreement, floor)
    change = _change_pct(run, on)
    if change is not None:
        detail += f"; decode {run.result.decode_tok_s:.1f} tok/s as NVFP4 against {on.result.decode_tok_s:.1f} as BF16"
    status = "passed"
    if run.result.error:
        status, detail = "failed", f"{run.result.error}; {detail}"
    return run, PleFormatAB(format="nvfp4", status=status, against_floor=against, detail=detail, run=run.result.name,
                            agreement=agreement, decode_change_pct=change)


def run_gpu_part(deployment, patches, launcher: Launcher, runs_dir: Path, out_root: Path,
                 progress: Callable[[str], None], ready_timeout_s: float = 900.0,
                 ple_view: Path | None = None) -> GpuPart:
    """The runs of ``deployment`` (the profile serving the demo checkpoint, with its PLE table file
    where the profile serves one) in order: all on, all on again (A/A), then each switch off, then
    (``ple_view``: the demo with the NVFP4 PLE overlay applied) the PLE table as NVFP4; and the verdicts."""
    model, profile, ple_table = deployment.model, deployment.profile, deployment.ple_table
    runs_dir.mkdir(parents=True, exist_ok=True)
    sw = switches(patches, profile.env, ple_table)
    base_env = {**profile.env, **{s.name: s.on for s in sw}}

    def argv(port: int) -> list[str]:
        return vllm_serve_argv(model, profile, port)

    part = GpuPart()
    total = len(sw) + 2 + (ple_view is not None)
    progress(f"[1/{total}] serving the demo with every patch on")
    on = serve_and_bench(launcher, "on", argv, base_env, {}, runs_dir, out_root, None, ready_timeout_s)
    part.runs.append(on)
    if on.report is None:
        for s in sw:
            part.verdicts[s.patch] = ("could_not_run", f"the run with every patch on failed: {on.result.error}",
                                      None, None)
        if ple_view is not None:
            part.ple_ab = PleFormatAB(format="nvfp4", status="could_not_run", against_floor="could_not_run",
                                      detail=f"the run with every patch on (the BF16 table) failed: {on.result.error}",
                                      run=None, agreement=None, decode_change_pct=None)
        return part
    progress(f"[2/{total}] the A/A rerun, every patch on")
    again = serve_and_bench(launcher, "on-again", argv, base_env, {}, runs_dir, out_root, on.report, ready_timeout_s)
    part.runs.append(again)
    if again.report is not None and again.report.ab is not None:
        part.noise_floor = _agreement(again.report.ab.agreement)
    for i, s in enumerate(sw, start=3):
        progress(f"[{i}/{total}] {s.patch} off ({s.line})")
        if s.on == s.off:
            part.verdicts[s.patch] = ("could_not_run", f"{s.name} is {s.on!r} with every patch on here too "
                                      "(the profile leaves this patch off)", None, None)
            continue
        run = serve_and_bench(launcher, f"off:{s.patch}", argv, {**base_env, s.name: s.off}, {s.name: s.off},
                              runs_dir, out_root, on.report, ready_timeout_s)
        part.runs.append(run)
        if run.report is None:
            part.verdicts[s.patch] = ("could_not_run", f"with {s.line}: {run.result.error}", None, None)
            continue
        agreement = _agreement(run.report.ab.agreement if run.report.ab else None)
        v, detail = verdict(agreement, part.noise_floor)
        change = _change_pct(run, on)
        if change is not None:
            detail += f"; decode {run.result.decode_tok_s:.1f} tok/s off against {on.result.decode_tok_s:.1f} on"
        if run.result.error:
            v, detail = "disagree", f"{run.result.error}; {detail}"
        part.verdicts[s.patch] = (v, detail, agreement, change)
    if ple_view is not None:
        progress(f"[{total}/{total}] the PLE table as NVFP4 ({ple_view}) against BF16, every patch on")
        run, part.ple_ab = ple_format_ab(launcher, profile, ple_view, base_env, on, part.noise_floor, runs_dir,
                                         out_root, ready_timeout_s)
        part.runs.append(run)
    return part
