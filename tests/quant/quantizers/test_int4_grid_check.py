"""The grid check every method's output passes before benchmarks/calibrated_quality.py scores it
(issue 33). Plain torch: no AutoRound or llm-compressor needed."""

import math

import pytest
import torch

from benchmarks.baselines import autoround_opt_rtn, llmcompressor_mse
from benchmarks.calibrated_quality import check_int4_grid, quantization_failure
from flashnext.quant.demo import heavy_tailed
from flashnext.quant.quantizers.mse_rtn import dequantize, quantize_absmax_rtn, quantize_mse_rtn

GROUP = 128


@pytest.fixture(scope="module")
def weight():
    return heavy_tailed(3, (64, 512)).float()


def _on_grid(weight, scale_sign=1.0):
    """Round-to-nearest on absmax/7 scales, in float32: a plain symmetric INT4 g128 weight."""
    x = weight.reshape(-1, GROUP)
    s = scale_sign * x.abs().amax(dim=1, keepdim=True) / 7
    return ((x / s).round().clamp(-8, 7) * s).reshape(weight.shape)


def test_a_grid_weight_passes(weight):
    assert check_int4_grid(weight, _on_grid(weight)) is None
    assert check_int4_grid(weight, _on_grid(weight, -1.0)) is None  # negative scales: codes -7..8 of |s|


@pytest.mark.parametrize("quantize", [quantize_absmax_rtn, quantize_mse_rtn, autoround_opt_rtn, llmcompressor_mse])
def test_the_quantizers_outputs_pass(weight, quantize):
    # flashnext's dequantize multiplies in the scale's bf16, so the products are bf16-rounded.
    q = quantize(weight)
    assert check_int4_grid(weight, dequantize(q.codes, q.scale, GROUP).float()) is None


def test_autoround_style_zero_point_weight_passes(weight):
    # AutoRound's sym INT4: unsigned codes 0..15 with zp 8, w = (q - 8) * s.
    x = weight.reshape(-1, GROUP)
    s = x.abs().amax(dim=1, keepdim=True) / 8
    q = ((x / s).round() + 8).clamp(0, 15)
    assert check_int4_grid(weight, ((q - 8) * s).reshape(weight.shape)) is None


def test_the_original_weight_fails_even_on_a_grid(weight):
    assert "identical to the original" in check_int4_grid(weight, weight.clone())
    grid = _on_grid(weight)
    assert "identical to the original" in check_int4_grid(grid, grid.clone())


def test_a_17_level_group_fails(weight):
    q = _on_grid(weight)
    s = 0.01
    q[5, 128:256] = torch.arange(-8, 9).repeat(8)[:128].float() * s  # codes -8..8: 17 levels, one scale
    why = check_int4_grid(weight, q)
    assert why is not None and "17 distinct values" in why and "row 5, columns 128..255" in why


def test_two_scales_in_a_group_fail(weight):
    q = _on_grid(weight)
    codes = torch.arange(-3, 4).repeat(10)[:64].float()  # 7 levels each half: 13 values in all
    q[2, :64] = codes * 0.01
    q[2, 64:128] = codes * 0.01 * math.sqrt(3)
    why = check_int4_grid(weight, q)
    assert why is not None and "no one scale" in why and "row 2, columns 0..127" in why


def test_off_grid_values_fail(weight):
    q = _on_grid(weight)
    q[7, 256:384] = torch.tensor([0.0, 1.0, math.sqrt(2), math.pi]).repeat(32) * 0.01  # 4 levels, off any grid
    why = check_int4_grid(weight, q)
    assert why is not None and "no one scale" in why
    # Nudging a single value of a grid weight by a tenth of a step is off-grid too.
    q = _on_grid(weight)
    step = float(weight[0, :GROUP].abs().max()) / 7
    q[0, 3] += 0.1 * step
    assert check_int4_grid(weight, q) is not None


def test_shape_and_missing_layers_fail(weight):
    assert "shape" in check_int4_grid(weight, _on_grid(weight)[:, :256])
    q = _on_grid(weight)
    assert quantization_failure({"a": weight, "b": weight}, {"a": q}) == "no weights for 1 Linears (b)"
    assert quantization_failure({"a": weight}, {"a": q}) is None
    assert quantization_failure({"a": weight}, {"a": weight.clone()}).startswith("a: identical")
