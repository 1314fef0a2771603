import pytest
import torch

from flashnext.errors import FlashnextError
from flashnext.quant.demo import heavy_tailed
from flashnext.quant.quantizers.mse_rtn import MseSearch, quantize_absmax_rtn, quantize_mse_rtn


def group_sq_err(w, q, gs):
    err = q.dequantize(torch.float32) - w
    return (err ** 2).view(-1, gs).sum(dim=1)


@pytest.fixture(scope="module")
def weights():
    return heavy_tailed(7, (256, 512)).float()


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_codes_in_range_and_shapes(weights, gs):
    q = quantize_mse_rtn(weights, 4, gs)
    assert q.codes.dtype == torch.int8 and q.codes.shape == weights.shape
    assert q.scale.dtype == torch.bfloat16 and q.scale.shape == (256, 512 // gs)
    assert int(q.codes.min()) >= -8 and int(q.codes.max()) <= 7


def test_never_worse_than_absmax_rtn_in_any_group(weights):
    # The grid contains absmax/7.5 (compressed-tensors' own scale) and only improvements are kept.
    ours = group_sq_err(weights, quantize_mse_rtn(weights), 128)
    absmax = group_sq_err(weights, quantize_absmax_rtn(weights), 128)
    assert bool((ours <= absmax).all())
    assert float(ours.sum()) <= 0.78 * float(absmax.sum())


def test_positive_scales_only_when_asked(weights):
    free = quantize_mse_rtn(weights)
    assert bool((free.scale < 0).any()), "signed search should use negative scales somewhere"
    pos = quantize_mse_rtn(weights, search=MseSearch(positive_scales=True))
    assert bool((pos.scale >= 0).all())
    assert float(group_sq_err(weights, pos, 128).sum()) >= float(group_sq_err(weights, free, 128).sum())


def test_error_is_evaluated_with_the_stored_scale(weights):
    # Requantizing with the stored bf16 scale reproduces exactly the stored codes.
    q = quantize_mse_rtn(weights)
    s = q.scale.float().repeat_interleave(128, dim=1)
    s = torch.where(s == 0, torch.ones_like(s), s)
    assert torch.equal((weights / s).round().clamp(-8, 7).to(torch.int8), q.codes)


def test_all_zero_and_tiny_groups():
    w = torch.zeros(2, 256)
    w[1, 128:] = torch.linspace(-1e-30, 1e-30, 128)
    q = quantize_mse_rtn(w)
    assert q.scale[0].float().eq(0).all() and q.codes[0].eq(0).all()
    assert q.scale[1, 0] == 0
    assert torch.isfinite(q.dequantize()).all()


def test_chunking_does_not_change_the_result(weights):
    a = quantize_mse_rtn(weights, chunk_groups=7)
    b = quantize_mse_rtn(weights, chunk_groups=1 << 20)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("gs", [16, 96])
def test_bad_group_size(weights, gs):
    with pytest.raises(FlashnextError, match="group size"):
        quantize_mse_rtn(weights, group_size=gs)


def test_k_not_divisible():
    with pytest.raises(FlashnextError, match="not divisible"):
        quantize_mse_rtn(torch.randn(4, 192), group_size=128)


def test_the_registry_names_each_quantizer(demo_snapshot, tmp_path):
    from flashnext.quant.overlays.hub import render_model_card
    from flashnext.quant.overlays.manifest import OverlayManifest
    from flashnext.quant.overlays.mtp_int4 import MtpInt4Options, make_mtp_int4
    from flashnext.quant.quantizers.base import available_quantizers, get_quantizer

    assert available_quantizers() == ["gptq", "mse", "rtn"]
    with pytest.raises(FlashnextError, match="no quantizer 'gptq4'; available: gptq, mse, rtn"):
        get_quantizer("gptq4")
    w = torch.randn(8, 256)
    assert torch.equal(get_quantizer("rtn").quantize(w, 4, 128, torch.bfloat16).codes,
                       quantize_absmax_rtn(w, 4, 128, torch.bfloat16).codes)
    for name, phrase in (("mse", "MSE-searched"), ("rtn", "absmax scales")):
        out = tmp_path / name
        report = make_mtp_int4(demo_snapshot, out, MtpInt4Options(quantizer=name), progress=False)
        assert report["quantizer"] == name
        card = render_model_card(OverlayManifest.load(out), "me/x")
        assert phrase in card and ("MSE-searched" not in card if name == "rtn" else True)
