"""``flashnext selftest``'s CPU part through the CLI on this machine (no GPU): the series check, the
kernel fit and the PLE formats' read-back run vLLM 0.34.0's real code; the GPU part says it could
not run, per patch and for the PLE table as NVFP4.

The kernel fit's one stand-in is the CUDA platform as vLLM's kernel chooser sees it (a Platform with
the CUDA enum at capability 8.6 or 9.0): vLLM's CudaPlatform needs libcuda to import.
"""

import json

import jsonschema
import pytest
from click.testing import CliRunner

from flashnext.quant.demo import demo_config
from flashnext.serving.selftest.report import SelftestReport, load_report
from flashnext.tools.cli import main
from support import ROOT

SCHEMA = ROOT / "manifests" / "selftest-report.schema.json"



def test_a_report_with_an_unknown_key_is_refused_in_one_line(tmp_path):
    from flashnext.errors import FlashnextError

    bad = tmp_path / "report.json"
    bad.write_text(json.dumps({"schema_version": 1, "surprise": True}))
    with pytest.raises(FlashnextError, match="not a flashnext selftest report"):
        load_report(bad)


def test_a_taken_out_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "out").mkdir()
    done = CliRunner().invoke(main, ["selftest", "--out", str(tmp_path / "out"), "--gpus", "0"])
    assert done.exit_code == 1 and "already exists" in done.output
    done = CliRunner().invoke(main, ["selftest", "--out", str(tmp_path / "x"), "--gpus", "two"])
    assert done.exit_code == 2 and "auto or a number" in done.output
    done = CliRunner().invoke(main, ["selftest", "--out", str(tmp_path / "y"), "--profile", "nope"])
    assert done.exit_code == 1 and "no serving profile 'nope'" in done.output and not (tmp_path / "y").exists()


@pytest.mark.slow
def test_the_cpu_part_end_to_end_through_the_cli(tmp_path):
    pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")
    out = tmp_path / "selftest"
    done = CliRunner().invoke(main, ["selftest", "--out", str(out), "--json"])  # stdout: the JSON; stderr: progress
    assert done.exit_code == 0, done.output
    raw = json.loads((out / "report.json").read_text())
    jsonschema.validate(raw, json.loads(SCHEMA.read_text()))
    report = SelftestReport.model_validate(raw)
    assert report.summary.ok and report.series.status == "passed" and len(report.series.patches) == len(report.patches)
    fit = report.kernel_fit
    assert fit.status == "passed", fit.detail
    by = {(row.layer.removeprefix("language_model.model."), row.capability): row for row in fit.layers}
    # What vLLM's chooser picks differs by capability; the layer fits the kernel meant for it at both.
    assert by[("layers.0.mlp.experts.routed_experts", 86)].kernel.startswith("MARLIN")
    assert by[("layers.1.ple.kv_proj", 86)].kernel == "MarlinLinearKernel"  # INT8 g128
    assert by[("layers.1.ple.kv_proj", 90)].kernel == "MacheteLinearKernel"
    assert by[("layers.1.ple.kv_proj", 90)].marlin == "ok"
    assert by[("layers.3.self_attn.o_proj", 86)].kernel == "HummingLinearKernel"  # INT6 g64
    assert by[("layers.3.self_attn.o_proj", 86)].marlin.startswith("Quant type (uint6b32) not supported")
    assert {row.capability for row in fit.layers} == {86, 90}
    # With the patches, int8-modules builds the mixers with flashnext's INT8 method, not a vLLM kernel.
    assert not any("hyper_connection" in row.layer for row in fit.layers)
    assert report.gpu_part == "could_not_run" and report.gpu_detail == "no CUDA GPU here"
    for p in report.patches:
        assert p.probe == "passed" and p.ab == "could_not_run" and "no CUDA GPU here" in p.ab_detail, p
    assert {p.id for p in report.patches if p.kernel_fit} == {"decode-05", "int6-bitplane"}
    # The PLE formats: vLLM's own Qwen4ExpNGramEmbedding (in the interpreter of the kernel fit, from
    # the patched tree) read every row of each overlay as flashnext's decoder does.
    ple = report.ple_formats
    assert ple.status == "passed", ple.detail
    by = {c.format: c for c in ple.formats}
    assert by["nvfp4"].vllm_method == "Qwen4ExpPLENvFp4EmbeddingMethod"
    assert by["fp8"].vllm_method == "Qwen4ExpPLEFp8EmbeddingMethod"
    for c in by.values():
        assert c.rows == 16896 and c.rows_differing == 0 and 0 < c.relative_mse < c.error_bound
        assert c.allocated_bytes == c.preflight_bytes and c.vllm_backend == "Qwen4ExpPLEDeviceEmbedding"
    ab = report.ple_format_ab
    assert ab.status == "could_not_run" and "no CUDA GPU here" in ab.detail
    assert "--pipeline-parallel-size" in report.vllm_command
    page = (out / "report.html").read_text()
    assert "could not run" in page and "MarlinLinearKernel" in page and "<script" not in page
    assert "Qwen4ExpPLENvFp4EmbeddingMethod" in page and "not the real model" in page
    summary = json.loads(done.stdout)
    assert summary["ok"] is True and summary["patches"]["decode-03"] == "could_not_run"
    assert summary["headline"].startswith("PARTIAL: ") and "<h1>flashnext selftest: PARTIAL: " in page
    assert summary["ple_formats"]["nvfp4"] == {"status": "passed", "rows_differing": 0,
                                               "relative_mse": by["nvfp4"].relative_mse}
    assert summary["ple_format_ab"]["status"] == "could_not_run"


@pytest.mark.slow
def test_the_kernel_fit_catches_k_that_is_not_a_multiple_of_the_group_size(tmp_path):
    """A demo whose PLE key/value projection has K = 192 under INT8 group 128: vLLM refuses to build
    the layer at either capability, and the check says which layer and why."""
    pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")
    from flashnext.serving.selftest.runner import check_kernel_fit

    config = demo_config()
    config["text_config"]["ple_embed_dim"] = 192
    fit = check_kernel_fit(config, tmp_path, tree=None)
    assert fit.status == "failed"
    assert "layers.1.ple.kv_proj" in fit.detail and "not divisible by group_size=128" in fit.detail, fit.detail
    assert "capability 8.6" in fit.detail and "and 1 more" in fit.detail  # 9.0 too


def test_the_demo_tokenizer_loads_with_the_demo_configs_special_ids(tmp_path):
    from transformers import AutoTokenizer

    from flashnext.serving.selftest.tokenizer import write_tokenizer

    (tmp_path / "config.json").write_text(json.dumps(demo_config()))
    write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == demo_config()["text_config"]["vocab_size"]
    assert tok.eos_token_id == demo_config()["text_config"]["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|image_pad|>") == demo_config()["image_token_id"]
    ids = tok.apply_chat_template([{"role": "user", "content": "hé"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert max(ids) < len(tok) and tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_without_vllm_it_says_what_to_install_and_leaves_nothing(tmp_path, monkeypatch):
    from flashnext.serving import vllm_release

    monkeypatch.setattr(vllm_release, "installed_version", lambda: None)  # as in the wheel's fresh venv without vLLM
    done = CliRunner().invoke(main, ["selftest", "--out", str(tmp_path / "out")])
    assert done.exit_code == 1 and "pip install 'flashnext[serve]'" in done.output, done.output
    assert len(done.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


# --- issue 41: a request for GPUs that are not here is refused up front; the headline is honest ------

def test_more_gpus_than_are_here_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """`--gpus 3` on a machine without GPUs ran the CPU part (minutes) and then said it could not run
    the GPU part; now it is refused at once, in one line, with nothing written."""
    import flashnext.serving.selftest as selftest_package
    from flashnext.serving import preflight

    monkeypatch.setattr(preflight, "visible_gpus", lambda: [])
    monkeypatch.setattr(selftest_package, "selftest", lambda *a, **k: pytest.fail("the selftest ran"))
    done = CliRunner().invoke(main, ["selftest", "--out", str(tmp_path / "out"), "--gpus", "3"])
    lines = done.output.strip().splitlines()
    assert done.exit_code == 1 and len(lines) == 1, done.output
    assert lines[0] == "Error: --gpus 3: 0 GPU(s) visible here (NVML, nvidia-smi); pass --gpus auto, or --gpus 0 " \
                       "for the CPU part only"
    assert not (tmp_path / "out").exists()


def test_the_headline_says_how_many_checks_ran():
    """Before issue 41: "OK" and exit 0 when 20 of 23 checks could not run."""
    from flashnext.serving.selftest.report import Summary, headline

    assert headline(Summary(ok=True, passed=3, failed=0, could_not_run=20, lines=[])) == \
        "PARTIAL: 3 of 23 checks ran, all passed; 20 could not run here"
    assert headline(Summary(ok=True, passed=23, failed=0, could_not_run=0, lines=[])) == "OK: all 23 checks passed"
    assert headline(Summary(ok=False, passed=2, failed=1, could_not_run=20, lines=[])) == \
        "FAILED: 1 of the 3 checks that ran failed, 20 could not run here"


def test_a_partial_run_prints_partial_and_exits_0(tmp_path, monkeypatch):
    import types

    import flashnext.serving.selftest as selftest_package
    from flashnext.serving.selftest.report import Summary

    summary = Summary(ok=True, passed=3, failed=0, could_not_run=20, lines=["could not run GPU part: no CUDA GPU here"])
    monkeypatch.setattr(selftest_package, "selftest", lambda *a, **k: (types.SimpleNamespace(summary=summary), None))
    done = CliRunner().invoke(main, ["selftest", "--out", str(tmp_path / "out"), "--gpus", "0"])
    assert done.exit_code == 0, done.output
    assert done.stdout.splitlines()[-1].startswith("PARTIAL: 3 of 23 checks ran, all passed; 20 could not run here; "
                                                   "wrote "), done.stdout
