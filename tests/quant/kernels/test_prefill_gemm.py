"""The tiled prefill GEMM (INT6 bit planes, INT8 words) against a float32 reference: through Triton's
CPU interpreter here, at the real shapes on the GPU machine (``-m gpu``). Its sm_86 compile (the
3090's rows fit its shared memory) is ``test_sm86_fit.py``'s."""

import pytest
import torch

from flashnext.quant.formats.packing import pack_int32
from flashnext.quant.kernels import configs
from flashnext.quant.kernels.decode_mma import bitplane_matmul, int8_matmul
from flashnext.quant.kernels.prefill_gemm import bitplane_gemm, int8_gemm
from test_decode_mma import case as int6_case  # the decode kernels' cases and tolerance
from test_decode_mma import check as within_one_rounding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check(y, ref):
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    within_one_rounding(y, ref)


def int8_case(n, k, group, m, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(n, k // group, generator=g) * 0.01).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    ref = x.float() @ (q.float() * s.float().repeat_interleave(group, 1)).T
    return x.to(DEVICE), pack_int32(q, 8).to(DEVICE), s.to(DEVICE), ref.to(DEVICE)


@pytest.mark.parametrize("m", [17, 45])
@pytest.mark.parametrize("tile", [(32, 64), (16, 32)])
def test_int6_matches_the_reference(m, tile):
    """Token and row counts that leave partial tiles on both sides (45 tokens, 80 rows)."""
    x, planes, scales, ref = int6_case(80, 256, 64, m, seed=m)
    check(bitplane_gemm(x, planes, scales, block_m=tile[0], block_n=tile[1]), ref)


def test_int6_group_of_128_and_four_groups_a_step():
    x, planes, scales, ref = int6_case(64, 512, 128, 33, seed=3)
    check(bitplane_gemm(x, planes, scales, config=configs.GemmConfig(steps=(256,))), ref)


@pytest.mark.parametrize("group", [64, 128])
def test_int8_matches_the_reference(group):
    x, packed, scales, ref = int8_case(72, 256, group, 40, seed=group)
    check(int8_gemm(x, packed, scales), ref)


def test_the_matmuls_take_prefill_batches_through_it(monkeypatch):
    """``bitplane_matmul`` and ``int8_matmul`` (what the int6-bitplane and int8-modules layers call)
    hand a batch of more than 16 tokens to this GEMM, not to a dequantized bf16 copy; INT8 only
    where its tiles fill the device (:func:`fills_device`), else the dequantized copy, which
    measured faster there."""
    from flashnext.quant.kernels import decode_mma, prefill_gemm

    launched = []
    for name in ("bitplane_gemm", "int8_gemm"):
        real = getattr(prefill_gemm, name)
        monkeypatch.setattr(decode_mma, name, lambda *a, _real=real, _name=name: launched.append(_name) or _real(*a))
    x, planes, scales, ref = int6_case(48, 256, 64, 24, seed=5)
    check(bitplane_matmul(x, planes, scales), ref)
    assert launched == ["bitplane_gemm"]
    sms = decode_mma._common.sm_count(x.device)
    rows = sms * configs.config_for("int8_gemm", device=x.device).block_n  # one tile a SM at 24 tokens
    assert prefill_gemm.fills_device("int8_gemm", 24, rows, 256, x.device)
    x, packed, scales, ref = int8_case(rows, 256, 128, 24, seed=6)
    check(int8_matmul(x, packed, scales), ref)
    assert launched == ["bitplane_gemm", "int8_gemm"]
    assert not prefill_gemm.fills_device("int8_gemm", 24, rows - 64, 256, x.device)
    x, packed, scales, _ = int8_case(rows - 64, 256, 128, 24, seed=7)
    int8_matmul(x, packed, scales)
    assert launched == ["bitplane_gemm", "int8_gemm"]


def test_an_empty_batch_and_refusals():
    x, planes, scales, _ = int6_case(32, 128, 64, 17, seed=1)
    assert bitplane_gemm(x[:0], planes, scales).shape == (0, 32)
    with pytest.raises(ValueError, match="planes must be"):
        bitplane_gemm(x, planes[:, :-1], scales)
    with pytest.raises(ValueError, match="do not fit"):
        bitplane_gemm(x, planes, scales[:-1])
    with pytest.raises(ValueError, match="packed must be"):
        int8_gemm(x, torch.zeros(32, 31, dtype=torch.int32, device=DEVICE), scales)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1280, 2560), (2560, 640), (10240, 2560), (2560, 6144)])
@pytest.mark.parametrize("m", [17, 512, 1000])
def test_real_shapes(n, k, m):
    x, planes, scales, ref = int6_case(n, k, 64, m, seed=n + m)
    check(bitplane_gemm(x, planes, scales), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,group", [(336, 10240, 64), (10240, 320, 64), (32768, 2560, 128)])
def test_real_int8_shapes(n, k, group):
    x, packed, scales, ref = int8_case(n, k, group, 512, seed=n)
    check(int8_gemm(x, packed, scales), ref)
