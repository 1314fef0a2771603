"""The selftest's GPU part, orchestrated against a stand-in for ``vllm serve``.

vLLM cannot serve here (no GPU) nor on the GPU machine available to us (its vLLM build has no
CUDA kernels), so the process the selftest launches is ``tests/support/selftest_standin_server.py``,
an OpenAI-compatible stand-in on loopback. Only the process boundary is replaced: the launcher
records the exact ``vllm serve`` command line and environment the selftest asked for and starts the
stand-in with that environment. Everything else is the selftest's own code: the switches from
the patch registry (serving/patches/series.py), the profile's layout, flashnext bench as a library with its baseline A/B, the A/A
floor, the verdicts, the report.
"""

import json
import subprocess
import sys

import jsonschema

from flashnext.serving.patch_series import load_series
from flashnext.serving.profiles import load_profile
from flashnext.serving.selftest import gpu, runner
from flashnext.serving.selftest.report import KernelFit, SelftestReport, SeriesCheck, Summary
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
            return subprocess.Popen([sys.executable, str(STANDIN), "--port", port, "--model", model], stdout=f,
                                    stderr=subprocess.STDOUT, env={**env, **self.knobs, "PATH": "/usr/bin:/bin"},
                                    start_new_session=True)


def test_every_switch_is_served_off_against_on_with_an_a_a_floor(tmp_path):
    profile, patches = load_profile("3x3090"), load_series()
    table = tmp_path / "ple-table.bin"
    # The stand-in diverges when decode-03 is off and refuses to start when pp-ple is off (as stock
    # vLLM refuses PP for a PLE model).
    launcher = StandInLauncher({"STANDIN_DIVERGE": "VLLM_PP_DEFER_RECV=0", "STANDIN_REFUSE": "VLLM_PP_PLE=0"})
    out = tmp_path / "out"
    lines: list[str] = []
    part = gpu.run_gpu_part(tmp_path / "demo", profile, patches, table, launcher, out / "runs", out, lines.append,
                            ready_timeout_s=60)

    # One server per run: all on, the A/A rerun, then each switch off, in series order.
    assert len(launcher.calls) == len(patches) + 2
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
    assert verdicts.pop("pp-ple") == "could_not_run"
    assert "ValueError: stand-in: this build refuses VLLM_PP_PLE=0" in part.verdicts["pp-ple"][1]
    assert set(verdicts.values()) == {"agree"}, verdicts
    agreement = part.verdicts["decode-03"][2]
    assert agreement.matching_fraction < 0.5 and agreement.mean_kl_nats > gpu.THRESHOLDS.kl_abs_nats
    assert "decode" in part.verdicts["mtp-03"][1] and part.verdicts["mtp-03"][3] is not None

    # Each run's bench report is flashnext bench's own, on disk; the selftest report carries all.
    for run in part.runs:
        if run.result.started:
            assert json.loads((out / run.result.bench_report).read_text())["endpoints"][0]["requests"] > 0
    series = SeriesCheck(status="passed", detail="stand-in for this test", patches=[p.id for p in patches])
    fit = KernelFit(status="passed", detail="not run by this test", capabilities=[86, 90], layers=[], stand_in="-")
    results = runner.patch_results(patches, series, fit, part, "")
    report = SelftestReport(
        flashnext_version="t", started_at="t", finished_at="t", profile="3x3090",
        machine={"cuda_gpus": 3, "gpu_names": [], "vllm_version": "0.33.0", "vllm_patched": True,
                 "unpatched_probe": None},
        series=series, kernel_fit=fit, gpu_part="passed", gpu_detail="", vllm_command=on_argv,
        thresholds=gpu.THRESHOLDS, runs=[r.result for r in part.runs], noise_floor=part.noise_floor, patches=results,
        summary=Summary(ok=True, passed=0, failed=0, could_not_run=0, lines=[]))
    summary = runner.summarize(report)
    assert not summary.ok and summary.failed == 1 and summary.passed == 3 + len(patches) - 2
    assert any(line.startswith("DISAGREES decode-03") for line in summary.lines)
    report.summary = summary
    runner.write_outputs(report, out)
    schema = json.loads((ROOT / "manifests" / "selftest-report.schema.json").read_text())
    jsonschema.validate(json.loads((out / "report.json").read_text()), schema)
    assert "DISAGREES" in (out / "report.html").read_text()


def test_a_server_that_never_comes_up_is_a_could_not_run_for_every_patch(tmp_path):
    profile, patches = load_profile("3x3090"), load_series()
    launcher = StandInLauncher({"STANDIN_REFUSE": "VLLM_QSA_KV_OFFLOAD=1"})  # refuses the all-on run
    part = gpu.run_gpu_part(tmp_path / "demo", profile, patches, None, launcher, tmp_path / "runs", tmp_path,
                            lambda line: None, ready_timeout_s=60)
    assert len(launcher.calls) == 1
    assert {v[0] for v in part.verdicts.values()} == {"could_not_run"}
    assert "every patch on failed" in part.verdicts["mtp-03"][1]


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
