"""decode-04's fused HC mix against the unfused path in torch: through Triton's CPU interpreter in
CI, on the GPU with ``-m gpu``."""
import pytest
import torch
import triton
import triton.language as tl

from flashnext.quant.formats.packing import pack_int32
from flashnext.quant.kernels._common import INTERPRETED
from flashnext.quant.kernels.hc_mix import hc_down_inject_silu, hc_mix, hc_up_gate_mix
from flashnext.quant.kernels.reference import reference_mix, round_toward_zero

HC = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROUND = round_toward_zero if INTERPRETED else None  # how the kernels' own bf16 stores round


def _int8(rows: int, cols: int, gen: torch.Generator, exact: bool, group: int = 64):
    codes = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int16).to(torch.int8)
    if exact:  # powers of two: every product and partial sum is exact in fp32
        scales = 2.0 ** -torch.randint(6, 10, (rows, cols // group), generator=gen).float()
    else:
        scales = torch.rand(rows, cols // group, generator=gen) * 2e-3 + 1e-4
    return pack_int32(codes, 8), scales.to(torch.bfloat16)


def _activations(m: int, k: int, gen: torch.Generator, exact: bool) -> torch.Tensor:
    if exact:
        return (torch.randint(-8, 9, (m, k), generator=gen).float() / 16).to(torch.bfloat16)
    return torch.randn(m, k, generator=gen).to(torch.bfloat16)


def _layer(hidden: int, lowrank: int, gen, exact: bool, inject: bool = True):
    rows = lowrank + (HC + (-(lowrank + HC)) % 16 if inject else 0)  # vLLM pads the merged rows to 16
    down = _int8(rows, HC * hidden, gen, exact)
    up = _int8(HC * hidden, lowrank, gen, exact)
    return down, up


@pytest.mark.parametrize("m", [1, 3, 16])
def test_mix_is_bit_exact_on_exact_inputs(m):
    """Exactly representable weights and activations: any summation order gives the same fp32 sums,
    so the fused kernels must equal the unfused path bit for bit, rounding points included."""
    dev = DEVICE
    gen = torch.Generator().manual_seed(m)
    down, up = _layer(256, 64, gen, exact=True)
    xn = _activations(m, HC * 256, gen, exact=True)
    want_block, want_inj, want_low = reference_mix(xn, down, up, 64, HC, ROUND)
    to = lambda t: tuple(v.to(dev) for v in t)
    low, inj = hc_down_inject_silu(xn.to(dev), *to(down), 64, HC)
    assert torch.equal(inj.cpu(), want_inj) and torch.equal(low.cpu(), want_low)
    block, inj2 = hc_mix(xn.to(dev), to(down), to(up), 64, HC)
    assert torch.equal(block.cpu(), want_block) and torch.equal(inj2.cpu(), want_inj)
    assert inj.stride(1) == 1 and inj.shape == (m, HC)  # what vLLM's hc_combine_norm asserts


def test_mix_matches_on_random_inputs():
    dev = DEVICE
    gen = torch.Generator().manual_seed(7)
    down, up = _layer(256, 64, gen, exact=False)
    xn = _activations(4, HC * 256, gen, exact=False)
    want_block, want_inj, _ = reference_mix(xn, down, up, 64, HC, ROUND)
    block, inj = hc_mix(xn.to(dev), tuple(v.to(dev) for v in down), tuple(v.to(dev) for v in up), 64, HC)
    ulp = lambda a, b: (a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-3)
    assert float(ulp(inj.cpu(), want_inj).max()) <= 2 ** -7  # at most one bf16 rounding apart
    assert float(ulp(block.cpu(), want_block).max()) <= 2 ** -6


def test_final_mixer_has_no_injection():
    dev = DEVICE
    gen = torch.Generator().manual_seed(3)
    down, up = _layer(128, 64, gen, exact=True, inject=False)
    xn = _activations(2, HC * 128, gen, exact=True)
    want_block, want_inj, _ = reference_mix(xn, down, up, 64, HC, ROUND)
    block, inj = hc_mix(xn.to(dev), tuple(v.to(dev) for v in down), tuple(v.to(dev) for v in up), 64, HC)
    assert inj is None and want_inj is None and torch.equal(block.cpu(), want_block)


def test_shapes_are_checked():
    gen = torch.Generator().manual_seed(0)
    down, up = _layer(128, 64, gen, exact=True)
    with pytest.raises(ValueError, match="1..16 tokens"):
        hc_up_gate_mix(torch.zeros(17, 64, dtype=torch.bfloat16), *up, torch.zeros(17, HC * 128), HC)
    with pytest.raises(ValueError, match="bf16"):
        hc_up_gate_mix(torch.zeros(2, 64, dtype=torch.half), *up, torch.zeros(2, HC * 128, dtype=torch.half), HC)
    with pytest.raises(ValueError, match="does not match"):
        hc_up_gate_mix(torch.zeros(2, 64, dtype=torch.bfloat16), *up, torch.zeros(2, 128), HC)


@triton.jit
def _sigmoid_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.sigmoid(tl.load(x_ptr + offsets, mask=offsets < n)), mask=offsets < n)


def triton_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Triton's own sigmoid on the GPU (an approximation there), as vLLM's unfused HC kernels use it."""
    flat = x.contiguous().cuda()
    out = torch.empty_like(flat)
    _sigmoid_kernel[(triton.cdiv(flat.numel(), 1024),)](flat, out, flat.numel(), BLOCK=1024)
    return out.cpu().view(x.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_real_shapes(m):
    """Qwen3.8-Flash-Next's HC: hidden 2560, 4 streams, low rank 320, merged rows padded to 336.

    The GEMMs and their rounding are checked bit for bit (the injection). The mix is compared with
    the reference made GPU-like (Triton's sigmoid, fused multiply-adds): Triton may compile the
    sigmoid differently in another kernel, so a rare element may land one bf16 step away
    (docs/benchmarks.md has the counts); vLLM's own GatedResidual is matched bit for bit through
    the interpreter (tests/serving/test_patch_series.py)."""
    gen = torch.Generator().manual_seed(100 + m)
    down, up = _layer(2560, 320, gen, exact=True)
    xn = _activations(m, HC * 2560, gen, exact=True)
    want_block, want_inj, _ = reference_mix(xn, down, up, 320, HC, sigmoid=triton_sigmoid, fused_multiply_add=True)
    block, inj = hc_mix(xn.cuda(), tuple(v.cuda() for v in down), tuple(v.cuda() for v in up), 320, HC)
    assert torch.equal(inj.cpu(), want_inj)
    got = block.cpu()
    steps = (got.view(torch.int16).int() - want_block.view(torch.int16).int()).abs()
    assert int(steps.max()) <= 1 and int((steps > 0).sum()) <= got.numel() // 1000, int((steps > 0).sum())
