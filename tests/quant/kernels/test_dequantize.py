"""The dequantization kernels (prefill through cuBLAS) against compressed-tensors-style host
dequantization of the same codes: ``bf16(q * s)``, rounded once, bit for bit. On the CPU through
Triton's interpreter; on the GPU (``gpu``) compiled."""

import pytest
import torch

from flashnext.quant.formats.bitplane import codes_to_bitplane
from flashnext.quant.formats.packing import dequantize_groups, pack_int32
from flashnext.quant.kernels.dequantize import bitplane_dequantize, int8_dequantize

SHAPES_INT6 = [(100, 640), (64, 256), (1, 128)]
SHAPES_INT8 = [(70, 512, 128), (33, 320, 64), (1, 128, 128)]



def _int6(n, k, device):
    g = torch.Generator().manual_seed(n * k)
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // 64, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    return codes, codes_to_bitplane(codes).to(device), scales.to(device)


def _int8(n, k, group, device):
    g = torch.Generator().manual_seed(n * k + group)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    return codes, pack_int32(codes, 8).to(device), scales.to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", SHAPES_INT6)
def test_bitplanes_dequantize_as_the_host_does(n, k, dtype):
    codes, planes, scales = _int6(n, k, "cpu")
    assert torch.equal(bitplane_dequantize(planes, scales, dtype), dequantize_groups(codes, scales, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,group", SHAPES_INT8)
def test_int8_words_dequantize_as_the_host_does(n, k, group, dtype):
    codes, packed, scales = _int8(n, k, group, "cpu")
    assert torch.equal(int8_dequantize(packed, scales, dtype), dequantize_groups(codes, scales, dtype))


@pytest.mark.gpu
def test_dequantize_on_the_gpu():
    for n, k in SHAPES_INT6 + [(1280, 2560), (2560, 640)]:
        codes, planes, scales = _int6(n, k, "cuda")
        want = dequantize_groups(codes, scales.cpu(), torch.bfloat16)
        assert torch.equal(bitplane_dequantize(planes, scales, torch.bfloat16).cpu(), want), (n, k)
    for n, k, group in SHAPES_INT8 + [(336, 10240, 64), (10240, 320, 64)]:
        codes, packed, scales = _int8(n, k, group, "cuda")
        want = dequantize_groups(codes, scales.cpu(), torch.bfloat16)
        assert torch.equal(int8_dequantize(packed, scales, torch.bfloat16).cpu(), want), (n, k, group)
