"""The selftest's "PLE formats" check, judged in the selftest's process: the demo's PLE table built as
NVFP4 and FP8 overlays (the real `flashnext ple build --format`), and what vLLM's read-back returned
held to flashnext's decoder and to the BF16 rows.

vLLM's own read-back (``Qwen4ExpNGramEmbedding`` in a fresh interpreter, beside the kernel fit) runs
in ``test_selftest_cpu.py``'s end-to-end test; here its result is given, to see that every way it
can be wrong is reported as a failure (and fails the selftest), without paying vLLM's import.
"""

from pathlib import Path

import pytest
import torch

from flashnext.quant.checkpoint.snapshot import Snapshot
from flashnext.quant.overlays.ple_quant import quantized_table_allocations
from flashnext.quant.ple.source import find_ple_source
from flashnext.serving.selftest import ple_formats, runner


@pytest.fixture(scope="module")
def built(demo_snapshot, tmp_path_factory):
    return ple_formats.build_views(Snapshot.open(demo_snapshot), tmp_path_factory.mktemp("ple-formats"))


def read_as_vllm_would(demo_snapshot, built, tmp_path, tamper=None) -> dict:
    """The read-back's result, its rows those of flashnext's decoder (``tamper(fmt, rows)``: changed)."""
    source = find_ple_source(Snapshot.open(demo_snapshot))
    out = {}
    for fmt, b in built.items():
        rows = ple_formats.decoded_table(Path(b["view"]), source, fmt)
        if tamper:
            tamper(fmt, rows)
        path = tmp_path / f"{fmt}.pt"
        torch.save(rows, path)
        out[fmt] = {"method": ple_formats.VLLM_METHODS[fmt], "backend": "Qwen4ExpPLEDeviceEmbedding",
                    "allocated": quantized_table_allocations(Snapshot.open(Path(b["view"]))),
                    "rows": {source.prefix: str(path)}}
    return out


def test_the_overlays_are_built_and_exact_rows_pass_with_the_formats_error(demo_snapshot, built, tmp_path):
    assert set(built) == {"nvfp4", "fp8"} and all("view" in b for b in built.values())
    checks = ple_formats.judge(Snapshot.open(demo_snapshot), built, read_as_vllm_would(demo_snapshot, built, tmp_path),
                               None)
    assert checks.status == "passed", checks.detail
    by = {c.format: c for c in checks.formats}
    rows = find_ple_source(Snapshot.open(demo_snapshot)).layout.padded_rows
    for fmt, c in by.items():
        assert c.rows == rows and c.rows_differing == 0 and 0 < c.relative_mse < c.error_bound
        # the error of the rows a server returns is the build's own report, up to summation order
        assert c.relative_mse == pytest.approx(built[fmt]["report"]["tables"][0]["relative_mse"], rel=1e-4)
    assert by["fp8"].relative_mse < by["nvfp4"].relative_mse
    assert "not the real model's" in checks.detail


def test_a_row_that_is_not_the_decoders_fails(demo_snapshot, built, tmp_path):
    def tamper(fmt, rows):
        if fmt == "nvfp4":
            rows[4225, 3] = -rows[4225, 3] if rows[4225, 3] != 0 else 1.0  # a nibble read wrong, in shard 1

    checks = ple_formats.judge(Snapshot.open(demo_snapshot), built,
                               read_as_vllm_would(demo_snapshot, built, tmp_path, tamper), None)
    by = {c.format: c for c in checks.formats}
    assert checks.status == "failed" and by["fp8"].status == "passed"
    assert by["nvfp4"].rows_differing == 1 and "1 of 16896 rows differ from flashnext's decoder (first: row 4225" \
        in by["nvfp4"].detail


def test_vllm_refusing_an_overlay_or_allocating_other_sizes_fails(demo_snapshot, built, tmp_path):
    read = read_as_vllm_would(demo_snapshot, built, tmp_path)
    read["nvfp4"] = {"error": "ValueError: ple_embedding_dtype must be 'nvfp4' or 'float8_e4m3fn'"}
    read["fp8"]["allocated"] = [123]
    checks = ple_formats.judge(Snapshot.open(demo_snapshot), built, read, None)
    by = {c.format: c for c in checks.formats}
    assert by["nvfp4"].status == "failed" and "vLLM could not read the overlay: ValueError" in by["nvfp4"].detail
    assert by["fp8"].status == "failed" and "the preflight counts" in by["fp8"].detail
    # the interpreter died before the read-back: both fail with its last line
    gone = ple_formats.judge(Snapshot.open(demo_snapshot), built, None,
                             "the vLLM interpreter stopped before the read-back: boom")
    assert [c.status for c in gone.formats] == ["failed", "failed"] and "boom" in gone.detail


def test_a_failed_build_is_a_failure_and_the_nvfp4_ab_says_why_it_could_not_run(demo_snapshot, built, tmp_path):
    broken = {**built, "nvfp4": {"error": "ple build --format nvfp4: not enough free space"}}
    read = read_as_vllm_would(demo_snapshot, built, tmp_path)
    checks = ple_formats.judge(Snapshot.open(demo_snapshot), broken, {"fp8": read["fp8"]}, None)
    assert checks.status == "failed" and "nvfp4: ple build --format nvfp4: not enough free space" in checks.detail


def test_a_failed_ple_formats_check_fails_the_selftest():
    from flashnext.serving.selftest import gpu
    from flashnext.serving.selftest.report import (
        KernelFit, PleFormatAB, PleFormats, SelftestReport, SeriesCheck, Summary,
    )

    report = SelftestReport(
        flashnext_version="t", started_at="t", finished_at="t", profile="3x3090",
        machine={"cuda_gpus": 0, "gpu_names": [], "vllm_version": "0.34.0", "vllm_patched": None,
                 "unpatched_probe": None},
        series=SeriesCheck(status="passed", detail="-", patches=[]),
        kernel_fit=KernelFit(status="passed", detail="-", capabilities=[86, 90], layers=[], stand_in="-"),
        ple_formats=PleFormats(status="failed", detail="nvfp4: 3 of 16896 rows differ", stand_in="-", formats=[]),
        gpu_part="could_not_run", gpu_detail="no CUDA GPU here", vllm_command=[], thresholds=gpu.THRESHOLDS, runs=[],
        noise_floor=None, patches=[],
        ple_format_ab=PleFormatAB(format="nvfp4", status="could_not_run", against_floor="could_not_run",
                                  detail="the A/B needs the GPU part: no CUDA GPU here", run=None, agreement=None,
                                  decode_change_pct=None),
        summary=Summary(ok=True, passed=0, failed=0, could_not_run=0, lines=[]))
    summary = runner.summarize(report)
    assert not summary.ok and summary.failed == 1 and summary.could_not_run == 2
    assert "FAILED PLE formats: nvfp4: 3 of 16896 rows differ" in summary.lines
    assert any("and of the PLE table as NVFP4 against BF16: no CUDA GPU here" in line for line in summary.lines)
