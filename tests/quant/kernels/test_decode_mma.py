"""The tensor-core decode GEMMs (INT6 bit-plane, INT8) against a float32 reference: through Triton's CPU interpreter here,
at the real shapes on the GPU machine (``-m gpu``)."""

import pytest
import torch

from flashnext.quant.formats.bitplane import codes_to_bitplane
from flashnext.quant.formats.packing import pack_int32
from flashnext.quant.kernels._common import INTERPRETED
from flashnext.quant.kernels.decode_mma import bitplane_matmul, bitplane_mma, int8_mma

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(n, k, group, m, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    s = (torch.randn(n, k // group, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = q.float() * s.float().repeat_interleave(group, 1)
    if not INTERPRETED:  # the INT6 kernel multiplies the weights a dense bf16 checkpoint would hold
        w = w.to(torch.bfloat16).float()
    ref = x.float() @ w.T
    return x.to(DEVICE), codes_to_bitplane(q).to(DEVICE), s.to(DEVICE), ref.to(DEVICE)


def check(y, ref):
    # products exact, fp32 sums in another order, one bf16 rounding of the output
    assert ((y.float() - ref).abs() <= 2 ** -7 * ref.abs().clamp_min(1.0)).all(), (y.float() - ref).abs().max()


@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("split", [1, 3])
def test_matches_the_reference(m, split):
    x, planes, scales, ref = case(80, 384, 64, m, seed=m + split)
    check(bitplane_mma(x, planes, scales, block_n=32, split_k=split), ref)


@pytest.mark.parametrize("m", [1, 3, 12])
def test_matmul_picks_a_kernel_for_each_batch(m):
    x, planes, scales, ref = case(64, 256, 64, m, seed=20 + m)
    check(bitplane_matmul(x, planes, scales), ref)


def test_group_of_128_and_the_automatic_launch():
    x, planes, scales, ref = case(64, 512, 128, 4, seed=9)
    check(bitplane_mma(x, planes, scales), ref)


@pytest.mark.parametrize("m", [1, 6])
def test_int8_from_compressed_tensors_words(m):
    g = torch.Generator().manual_seed(m)
    q = torch.randint(-128, 128, (48, 256), generator=g, dtype=torch.int8)
    s = (torch.rand(48, 2, generator=g) * 0.01).to(torch.bfloat16)
    x = torch.randn(m, 256, generator=g).to(torch.bfloat16)
    ref = x.float() @ (q.float() * s.float().repeat_interleave(128, 1)).T
    packed = pack_int32(q, 8)
    check(int8_mma(x.to(DEVICE), packed.to(DEVICE), s.to(DEVICE), block_n=16, split_k=2), ref.to(DEVICE))


def test_refuses_what_it_cannot_run():
    x, planes, scales, _ = case(32, 128, 64, 1, seed=1)
    with pytest.raises(ValueError, match="1..16 tokens"):
        bitplane_mma(torch.zeros(17, 128, dtype=torch.bfloat16, device=DEVICE), planes, scales)
    with pytest.raises(ValueError, match="planes must be"):
        bitplane_mma(x, planes[:, :-1], scales)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1280, 2560), (2560, 640), (8192, 8192), (16384, 16384)])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_real_shapes(n, k, m):
    x, planes, scales, ref = case(n, k, 64, m, seed=n + m)
    check(bitplane_mma(x, planes, scales), ref)


@pytest.mark.parametrize("m", [3, 20])
def test_int8_matmul_takes_any_batch(m):
    """Decode batches through the decode kernel, a larger batch over this small weight (one tile,
    fewer than the device's SMs) through a GEMM over the dequantized weights; each within one bf16
    rounding of the fp32 product."""
    from flashnext.quant.kernels.decode_mma import int8_matmul
    from flashnext.quant.kernels.prefill_gemm import fills_device

    g = torch.Generator().manual_seed(40 + m)
    q = torch.randint(-128, 128, (32, 256), generator=g, dtype=torch.int8)
    s = (torch.rand(32, 2, generator=g) * 0.01).to(torch.bfloat16)
    x = torch.randn(m, 256, generator=g).to(torch.bfloat16)
    w = q.float() * s.float().repeat_interleave(128, 1)
    kernel = (INTERPRETED or DEVICE == "cuda") and (m <= 16 or fills_device("int8_gemm", m, 32, 256, x.device))
    if not kernel:  # the bf16 GEMM multiplies the weights rounded to x's dtype
        w = w.to(torch.bfloat16).float()
    ref = x.float() @ w.T
    got = int8_matmul(x.to(DEVICE), pack_int32(q, 8).to(DEVICE), s.to(DEVICE))
    assert got.shape == (m, 32) and got.dtype == torch.bfloat16
    check(got, ref.to(DEVICE))
