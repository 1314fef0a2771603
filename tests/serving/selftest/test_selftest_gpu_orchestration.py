"""The selftest's GPU part, orchestrated against a stand-in for ``vllm serve``.

vLLM cannot serve here (no GPU) nor on the GPU machine available to us (its vLLM build has no
CUDA kernels), so the process the selftest launches is ``tests/support/selftest_standin_server.py``,
an OpenAI-compatible stand-in on loopback. Only the process boundary is replaced: the launcher
records the exact ``vllm serve`` command line and environment the selftest asked for and starts the
stand-in with that environment. Everything else is the selftest's own code: the switches from
the patch registry (serving/patches/series.py), the profile's layout, flashnext bench as a library with its baseline A/B, the A/A
floor, the verdicts, the report. The stand-in is also given the directory ``vllm serve`` was given,
so that it knows when it serves the demo's PLE table as NVFP4 (a view of the real overlay, built
here by ``flashnext ple build --format nvfp4``); what the format then changes is told to it by the
test, as the patches' effects are.
"""

import json
import subprocess
import sys

import jsonschema
import pytest

from flashnext.serving.deployment import Deployment
from flashnext.serving.patch_series import load_series
from flashnext.serving.profiles import load_profile
from flashnext.serving.selftest import gpu, runner
from flashnext.serving.selftest.report import KernelFit, PleFormats, SelftestReport, SeriesCheck, Summary
from support import ROOT, SUPPORT_DIR

STANDIN = SUPPORT_DIR / "selftest_standin_server.py"


class StandInLauncher(gpu.Launcher):
    """Starts the stand-in where the selftest starts ``vllm serve``; keeps what it was asked to run."""

    def __init__(self, knobs: dict[str, str]):
        self.knobs = knobs
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def start(self, argv, env, log):
        self.calls.append((argv, env))
        port = argv[argv.index("--port") + 1]
        model = argv[argv.index("--served-model-name") + 1]
        with open(log, "w") as f:
            return subprocess.Popen([sys.executable, str(STANDIN), "--port", port, "--model", model,
                                     "--model-path", argv[2]], stdout=f,
                                    stderr=subprocess.STDOUT, env={**env, **self.knobs, "PATH": "/usr/bin:/bin"},
                                    start_new_session=True)


@pytest.fixture(scope="module")
def nvfp4_view(demo_snapshot, tmp_path_factory):
    """The demo with its PLE table as NVFP4: a view of the overlay `flashnext ple build` writes."""
    from flashnext.quant.overlays.ple_quant import quantize_ple_table
    from flashnext.quant.overlays.view import apply_overlays

    root = tmp_path_factory.mktemp("ple-nvfp4")
    quantize_ple_table(demo_snapshot, root / "overlay", "nvfp4")
    apply_overlays(demo_snapshot, [root / "overlay"], root / "view")
    return root / "view"


def test_every_switch_is_served_off_against_on_with_an_a_a_floor(tmp_path, nvfp4_view):
    profile, patches = load_profile("3x3090"), load_series()
    table = tmp_path / "ple-table.bin"
    # The stand-in diverges when decode-03 is off and refuses to start when host-pool is off (a run
    # that cannot start; until vLLM 0.34.0 served PP for the PLE model itself, stock vLLM refused
    # pp-ple's switch this way); served the NVFP4 table, its logprobs move a little.
    launcher = StandInLauncher({"STANDIN_DIVERGE": "VLLM_PP_DEFER_RECV=0", "STANDIN_REFUSE": "VLLM_EXACT_HOST_POOL=0",
                                "STANDIN_PLE_SHIFT": "0.05"})
    out = tmp_path / "out"
    lines: list[str] = []
    part = gpu.run_gpu_part(Deployment(profile, tmp_path / "demo", ple_table=table), patches, launcher, out / "runs",
                            out, lines.append, ready_timeout_s=60, ple_view=nvfp4_view)

    # One server per run: all on, the A/A rerun, then each switch off, in series order, then NVFP4.
    assert len(launcher.calls) == len(patches) + 3
    on_argv, on_env = launcher.calls[0]
    assert on_argv[:3] == ["vllm", "serve", str(tmp_path / "demo")]
    args = on_argv[3:]
    assert args[args.index("--pipeline-parallel-size") + 1] == "3"  # the profile's PP, as many GPUs
    assert args[args.index("--max-model-len") + 1] == str(gpu.DEMO_MAX_MODEL_LEN)
    assert "262144" not in args and "--limit-mm-per-prompt" not in args and "--language-model-only" in args
    assert args[args.index("--mamba-cache-mode") + 1] == "align"  # the profile's cache modes stay
    assert on_env["VLLM_PLE_MMAP_PATH"] == str(table) and on_env["VLLM_QSA_KV_OFFLOAD"] == "1"
    assert launcher.calls[1] == launcher.calls[0] or launcher.calls[1][1] == on_env
    for patch, (argv, env) in zip(patches, launcher.calls[2:]):
        name, _, off = patch.env_switch.partition("=")
        assert {k for k in env if env[k] != on_env.get(k)} == {name} and env[name] == off, patch.id

    assert part.noise_floor is not None and part.noise_floor.matching_fraction == 1.0
    assert part.noise_floor.mean_kl_nats == 0.0
    verdicts = {pid: v[0] for pid, v in part.verdicts.items()}
    assert verdicts.pop("decode-03") == "disagree"
    assert verdicts.pop("host-pool") == "could_not_run"
    assert "ValueError: stand-in: this build refuses VLLM_EXACT_HOST_POOL=0" in part.verdicts["host-pool"][1]
    assert set(verdicts.values()) == {"agree"}, verdicts
    agreement = part.verdicts["decode-03"][2]
    assert agreement.matching_fraction < 0.5 and agreement.mean_kl_nats > gpu.THRESHOLDS.kl_abs_nats
    for pid in verdicts:  # each agreeing patch's detail gives its decode speed off against on
        assert "decode" in part.verdicts[pid][1] and part.verdicts[pid][3] is not None, pid

    # The PLE table as NVFP4: the view served with every patch on and no table file, against the
    # first run's BF16 table; the answers stay, the logprobs move a little (within the A/A limits).
    ple_argv, ple_env = launcher.calls[-1]
    assert ple_argv[2] == str(nvfp4_view) and ple_argv[3:-1] == on_argv[3:-1]  # all but the port
    assert {k for k in ple_env if ple_env[k] != on_env.get(k)} == {"VLLM_PLE_MMAP_PATH"}
    assert ple_env["VLLM_PLE_MMAP_PATH"] == ""
    ab = part.ple_ab
    assert ab.status == "passed" and ab.against_floor == "agree" and ab.run == "ple:nvfp4", ab
    assert ab.agreement.matching_fraction == 1.0 and 0 < ab.agreement.mean_kl_nats < gpu.THRESHOLDS.kl_abs_nats
    assert "as NVFP4 against" in ab.detail and part.runs[-1].result.name == "ple:nvfp4"

    # Each run's bench report is flashnext bench's own, on disk; the selftest report carries all.
    for run in part.runs:
        if run.result.started:
            assert json.loads((out / run.result.bench_report).read_text())["endpoints"][0]["requests"] > 0
    series = SeriesCheck(status="passed", detail="stand-in for this test", patches=[p.id for p in patches])
    fit = KernelFit(status="passed", detail="not run by this test", capabilities=[86, 90], layers=[], stand_in="-")
    results = runner.patch_results(patches, series, fit, part, "")
    ple = PleFormats(status="passed", detail="not run by this test", stand_in="-", formats=[])
    report = SelftestReport(
        flashnext_version="t", started_at="t", finished_at="t", profile="3x3090",
        machine={"cuda_gpus": 3, "gpu_names": [], "vllm_version": "0.34.0", "vllm_patched": True,
                 "unpatched_probe": None},
        series=series, kernel_fit=fit, ple_formats=ple, gpu_part="passed", gpu_detail="", vllm_command=on_argv,
        thresholds=gpu.THRESHOLDS, runs=[r.result for r in part.runs], noise_floor=part.noise_floor, patches=results,
        ple_format_ab=part.ple_ab, summary=Summary(ok=True, passed=0, failed=0, could_not_run=0, lines=[]))
    summary = runner.summarize(report)
    # the series, the kernel fit, the PLE formats, the GPU part, the patches that agree, the NVFP4 A/B
    assert not summary.ok and summary.failed == 1 and summary.passed == 4 + len(patches) - 2 + 1
    assert any(line.startswith("DISAGREES decode-03") for line in summary.lines)
    assert any(line.startswith("PLE table as NVFP4 against BF16 on the demo (within the A/A floor)")
               and "not the real model's" in line for line in summary.lines)
    report.summary = summary
    runner.write_outputs(report, out)
    schema = json.loads((ROOT / "manifests" / "selftest-report.schema.json").read_text())
    jsonschema.validate(json.loads((out / "report.json").read_text()), schema)
    page = (out / "report.html").read_text()
    assert "DISAGREES" in page and "The PLE table as NVFP4 against BF16" in page and "not the real model" in page


def _ple_only(tmp_path, nvfp4_view, knobs: dict[str, str]):
    """The all-on run, the A/A rerun and the NVFP4 run only (no patch switched off)."""
    launcher = StandInLauncher(knobs)
    demo = Deployment(load_profile("3x3090"), tmp_path / "demo", ple_table=tmp_path / "ple-table.bin")
    part = gpu.run_gpu_part(demo, [], launcher, tmp_path / "runs", tmp_path, lambda line: None, ready_timeout_s=60,
                            ple_view=nvfp4_view)
    assert [argv[2] for argv, _ in launcher.calls] == [str(tmp_path / "demo")] * 2 + [str(nvfp4_view)]
    return part


def _summary(part):
    series = SeriesCheck(status="passed", detail="-", patches=[])
    fit = KernelFit(status="passed", detail="-", capabilities=[86, 90], layers=[], stand_in="-")
    report = SelftestReport(
        flashnext_version="t", started_at="t", finished_at="t", profile="3x3090",
        machine={"cuda_gpus": 3, "gpu_names": [], "vllm_version": "0.34.0", "vllm_patched": True,
                 "unpatched_probe": None},
        series=series, kernel_fit=fit, ple_formats=PleFormats(status="passed", detail="-", stand_in="-", formats=[]),
        gpu_part="passed", gpu_detail="", vllm_command=[], thresholds=gpu.THRESHOLDS,
        runs=[r.result for r in part.runs], noise_floor=part.noise_floor, patches=[], ple_format_ab=part.ple_ab,
        summary=Summary(ok=True, passed=0, failed=0, could_not_run=0, lines=[]))
    return runner.summarize(report)


def test_a_format_that_moves_the_demos_logprobs_past_the_floor_is_reported_not_failed(tmp_path, nvfp4_view):
    """NVFP4 changes the table by design: beyond the A/A floor on the demo is a number to read (the
    demo's, not the real model's), not a fault of the machine."""
    part = _ple_only(tmp_path, nvfp4_view, {"STANDIN_PLE_SHIFT": "1.0"})
    ab = part.ple_ab
    assert ab.status == "passed" and ab.against_floor == "disagree", ab
    assert ab.agreement.matching_fraction == 1.0 and ab.agreement.mean_kl_nats > gpu.THRESHOLDS.kl_abs_nats
    summary = _summary(part)
    assert summary.ok and summary.failed == 0
    assert any("(beyond the A/A floor)" in line for line in summary.lines), summary.lines


def test_a_server_that_cannot_serve_the_nvfp4_table_fails_the_selftest(tmp_path, nvfp4_view):
    part = _ple_only(tmp_path, nvfp4_view, {"STANDIN_PLE_REFUSE": "1"})
    ab = part.ple_ab
    assert ab.status == "failed" and "cannot serve ple_embedding_dtype 'nvfp4'" in ab.detail, ab
    summary = _summary(part)
    assert not summary.ok and summary.failed == 1
    assert any(line.startswith("FAILED the PLE table as NVFP4") for line in summary.lines)


def test_a_server_that_never_comes_up_is_a_could_not_run_for_every_patch(tmp_path):
    profile, patches = load_profile("3x3090"), load_series()
    launcher = StandInLauncher({"STANDIN_REFUSE": "VLLM_QSA_KV_OFFLOAD=1"})  # refuses the all-on run
    part = gpu.run_gpu_part(Deployment(profile, tmp_path / "demo"), patches, launcher, tmp_path / "runs", tmp_path,
                            lambda line: None, ready_timeout_s=60)
    assert len(launcher.calls) == 1
    assert {v[0] for v in part.verdicts.values()} == {"could_not_run"}
    assert all("every patch on failed" in v[1] for v in part.verdicts.values())


def test_the_verdict_is_against_the_a_a_floor():
    from flashnext.serving.selftest.report import Agreement

    floor = Agreement(by="tokens", answers=8, identical=7, matching_fraction=0.97, mean_kl_nats=0.002)
    near = Agreement(by="tokens", answers=8, identical=7, matching_fraction=0.96, mean_kl_nats=0.006)
    far = Agreement(by="tokens", answers=8, identical=2, matching_fraction=0.60, mean_kl_nats=0.006)
    hot = Agreement(by="tokens", answers=8, identical=7, matching_fraction=0.97, mean_kl_nats=0.05)
    assert gpu.verdict(near, floor)[0] == "agree"
    assert gpu.verdict(far, floor)[0] == "disagree"
    assert gpu.verdict(hot, floor)[0] == "disagree"
    assert gpu.verdict(near, None)[0] == "could_not_run"


def test_the_pipeline_size_is_read_as_vllms_parser_reads_it():
    """Every spelling of the pipeline size a profile may carry gives the size vLLM's own parser gives
    (the selftest's reader saw only ``--pipeline-parallel-size N`` and ``-pp N`` before)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    profile = load_profile("3x3090")
    rest = list(profile.vllm_args)
    at = rest.index("--pipeline-parallel-size")
    rest = rest[:at] + rest[at + 2:]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    for spelled in (["--pipeline-parallel-size", "3"], ["--pipeline-parallel-size=3"], ["-pp", "3"], ["-pp=3"],
                    ["-pp", "2", "--pipeline-parallel-size=3"], []):
        varied = dataclasses.replace(profile, vllm_args=[*rest, *spelled])
        assert gpu.pipeline_size(varied) == parser.parse_known_args(list(varied.vllm_args))[0].pipeline_parallel_size
