"""make-mtp-int4 on a CUDA device. Skipped (visibly) where there is no GPU; results in docs/benchmarks.md."""

import json

import pytest
import torch
from safetensors.torch import load_file

from flashnext.quant.quantizers.mse_rtn import quantize_mse_rtn
from flashnext.quant.overlays.mtp_int4 import MtpInt4Options, make_mtp_int4
from flashnext.quant.formats.packing import pack_int32, unpack_int32

pytestmark = pytest.mark.gpu


def test_cuda_overlay_matches_cpu_quality(demo_snapshot, demo_overlay, tmp_path):
    report = make_mtp_int4(demo_snapshot, tmp_path / "ov", MtpInt4Options(device="cuda"), progress=False)
    cpu = json.loads((demo_overlay / "overlay.json").read_text())["report"]
    for proj, stats in report["projections"].items():
        assert stats["rel_mse"] == pytest.approx(cpu["projections"][proj]["rel_mse"], rel=2e-3)
        assert stats["ratio_to_absmax_rtn"] <= 0.78
    a = load_file(tmp_path / "ov" / "model-00005-of-00005.safetensors")
    b = load_file(demo_overlay / "model-00005-of-00005.safetensors")
    assert a.keys() == b.keys()
    same = sum(torch.equal(a[k], b[k]) for k in a if k.endswith("weight_scale"))
    assert same >= 0.9 * sum(k.endswith("weight_scale") for k in a)


def test_cuda_quantizer_and_packing():
    w = torch.randn(1024, 2560, device="cuda")
    q = quantize_mse_rtn(w)
    assert q.codes.device.type == "cuda"
    packed = pack_int32(q.codes, 4)
    assert torch.equal(unpack_int32(packed, 4, 2560), q.codes)
    assert torch.equal(packed.cpu(), pack_int32(q.codes.cpu(), 4))


def test_cuda_calibrated_gptq_matches_cpu(demo_snapshot, tmp_path):
    """--calib --quantizer gptq on the GPU: the same mode, and output errors within rounding noise of
    the CPU's (the Cholesky factors and sums differ in the last bits)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    save_file({"hidden_states": torch.randn(4096, 256, generator=g)}, str(tmp_path / "calib.safetensors"))
    options = dict(calib=tmp_path / "calib.safetensors", quantizer="gptq")
    gpu = make_mtp_int4(demo_snapshot, tmp_path / "gpu", MtpInt4Options(device="cuda", **options), progress=False)
    cpu = make_mtp_int4(demo_snapshot, tmp_path / "cpu", MtpInt4Options(**options), progress=False)
    assert gpu["mode"] == cpu["mode"] == "calibrated, GPTQ rounding"
    for proj, stats in gpu["projections"].items():
        assert stats["output_rel_mse"] == pytest.approx(cpu["projections"][proj]["output_rel_mse"], rel=0.1)
        assert stats["output_rel_mse"] > 0
