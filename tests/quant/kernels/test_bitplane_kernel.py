"""The bit-plane GEMV kernels against a float32 reference: through Triton's CPU interpreter here,
on the GPU machine with `-m gpu` (results in docs/benchmarks.md)."""

import pytest
import torch

from flashnext.quant.formats.bitplane import codes_to_bitplane
from flashnext.quant.kernels.bitplane_gemv import bitplane_down_combine, bitplane_gate_up_silu, bitplane_gemv
from flashnext.quant.kernels.configs import GemvConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def weights(n, k, gs, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    s = (torch.randn(n, k // gs, generator=g) * 0.02).to(torch.bfloat16)
    w = q.float() * s.float().repeat_interleave(gs, 1)
    return codes_to_bitplane(q).to(DEVICE), s.to(DEVICE), w.to(DEVICE)


def close(got, ref, out_dtype, scale=None):
    # exact in fp32 up to summation order; one bf16 rounding of the output otherwise. ``scale`` is
    # the magnitude the rounding is relative to, when it is not the result's own (a product).
    tol = 1e-4 if out_dtype == torch.float32 else 2 ** -7
    scale = ref.abs() if scale is None else scale
    assert ((got.float() - ref).abs() <= tol * scale.clamp_min(1.0)).all(), (got.float() - ref).abs().max()


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


SHAPES = [(48, 256, 64), (32, 512, 128)] if DEVICE == "cpu" else [(1280, 2560, 64), (2560, 640, 64), (96, 4096, 128)]


@pytest.fixture(params=["quad", "wide"])
def loads(request):
    """Both decode paths at the test shapes: four weights per load (the small matrices' default)
    and eight (the large matrices' default), as a launch configuration to pass."""
    return None if request.param == "quad" else GemvConfig(block_n=8, block_k=512, wide=True)


@pytest.mark.parametrize("n,k,gs", SHAPES)
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv(n, k, gs, m, dtype, loads):
    planes, s, w = weights(n, k, gs, n + k + m)
    x = randn(m, k, seed=m).to(dtype)
    close(bitplane_gemv(x, planes, s, launch=loads), x.float() @ w.T, dtype)


@pytest.mark.parametrize("m", [1, 3])
def test_gate_up_silu(m, loads):
    n, k, gs = SHAPES[0]
    planes, s, w = weights(2 * n, k, gs, 7)
    x = randn(m, k, seed=m)
    g, u = (x @ w.T).split(n, dim=1)
    # silu(g)*u carries the summation-order error of g and of u, each scaled by the other factor
    close(bitplane_gate_up_silu(x, planes, s, launch=loads), torch.nn.functional.silu(g) * u, torch.float32,
          scale=(g.abs() + 1) * (u.abs() + 1))


@pytest.mark.parametrize("m", [1, 2])
def test_down_combine(m, loads):
    n, k, gs = SHAPES[-1]
    planes, s, w = weights(n, k, gs, 9)
    x = randn(m, k, seed=m)
    routed = randn(m, n, seed=10 + m)
    gate = randn(m, 1, seed=20 + m)
    close(bitplane_down_combine(x, planes, s, routed, gate, launch=loads), routed + torch.sigmoid(gate) * (x @ w.T), torch.float32)


def test_bad_shapes():
    planes, s, _ = weights(16, 256, 64, 1)
    with pytest.raises(ValueError, match="1..4 tokens"):
        bitplane_gemv(torch.zeros(5, 256, device=DEVICE), planes, s)
    with pytest.raises(ValueError, match="uint8"):
        bitplane_gemv(torch.zeros(1, 128, device=DEVICE), planes, s)


@pytest.mark.gpu
def test_real_shapes_on_the_gpu():
    """The shared expert's shapes with bf16 activations, on CUDA."""
    for n, k in ((1280, 2560), (2560, 640)):
        planes, s, w = weights(n, k, 64, 3)
        x = randn(1, k).to(torch.bfloat16)
        close(bitplane_gemv(x, planes, s), x.float() @ w.T, torch.bfloat16)


@pytest.mark.gpu
def test_large_shape_on_the_gpu():
    """A matrix in the "large" class (eight weights per load) with bf16 activations, on CUDA."""
    planes, s, w = weights(4096, 4096, 64, 5)
    for m in (1, 4):
        x = randn(m, 4096, seed=m).to(torch.bfloat16)
        close(bitplane_gemv(x, planes, s), x.float() @ w.T, torch.bfloat16)
