"""The launch table's decisions timed both ways (``flashnext selftest``'s kernel choices): which
variant the table picks on a device, which measured fastest, and the advice where they differ.

Off a GPU the timer is a stand-in (named ``scripted``): it runs nothing and returns times in the
order the variants are timed, so the picks and the advice are checked against known answers; on
the GPU machine (``-m gpu``) the real timer runs every variant."""

import math

import pytest
import torch

from flashnext.quant.kernels import choices, configs
from flashnext.serving.selftest.runner import check_kernel_choices


def scripted(times):
    """A stand-in timer: the next of ``times`` for each function it is given, without running it."""
    it = iter(times)
    return lambda fn: next(it)


# how many functions time_choices times: two matrices and the step at each decode size, two variants
# each; the prefill GEMM at both matrices with every row the table holds for it; the prefill path
# (GEMM or dequantize + cuBLAS) at the two INT6 and the two INT8 matrices
TIMED = (3 * len(choices.DECODE_TOKENS) * 2 + 2 * len({f for (k, _, f) in configs.CONFIGS if k == "bitplane_gemm"})
         + (2 + len(choices.HC_INT8_SHAPES)) * 2)


def times(ascending: bool) -> list[float]:
    return [10.0 + i if ascending else 1000.0 * 0.8 ** i for i in range(TIMED)]


def points_with(ascending: bool):
    return choices.time_choices(torch.device("cpu"), timer=scripted(times(ascending)))


def test_the_picks_are_the_tables_for_the_device():
    points = points_with(ascending=True)
    assert {p.decision for p in points} == {"bitplane_matmul", "bitplane_mlp", "bitplane_gemm", "prefill"}
    by = {(p.decision, p.shape, p.tokens): p for p in points}
    # the default rows (what a 3090 gets): the GEMV up to 4 tokens below 2^22 weights, the fused step to 4
    assert all(by[("bitplane_matmul", shape, m)].table_picks == "gemv" for shape in ("1280x2560", "2560x640")
               for m in choices.DECODE_TOKENS)
    assert all(p.table_picks == "fused" for p in points if p.decision == "bitplane_mlp")
    assert all(p.table_picks == "row default" for p in points if p.decision == "bitplane_gemm")
    assert [p.table_picks for p in points if p.decision == "prefill"] == ["gemm"] * 4
    # each first-timed variant is the table's default pick here, and measured fastest: all agree
    assert all(p.agrees for p in points), [choices.advice(p) for p in points if not p.agrees]


def test_a_slower_pick_is_advice_with_the_row_to_change():
    points = points_with(ascending=False)
    slower = [p for p in points if not p.agrees]
    assert slower and all(p.fastest != p.table_picks for p in slower)
    line = choices.advice(slower[0])
    assert "should pick" in line and slower[0].fastest in line and "configs.py" in line


def test_the_selftest_reports_them_as_advice_not_failure():
    report = check_kernel_choices("cpu", timer=scripted(times(ascending=False)))
    assert report.status == "passed" and len(report.points) == len(points_with(ascending=True))
    assert "should pick" in report.detail and report.detail.startswith(f"{sum(p.agrees for p in report.points)} of")


@pytest.mark.gpu
def test_every_variant_runs_on_the_gpu():
    points = choices.time_choices(torch.device("cuda"))
    assert points and all(math.isfinite(t) and t > 0 for p in points for t in p.timings_us.values())
    for p in points:
        print(choices.advice(p))
