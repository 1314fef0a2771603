"""decode-04: the hyper-connection's GatedResidual mix in two kernels, reading INT8 weights as stored.

vLLM 0.33.0 runs one GatedResidual mix (given the normalized streams ``xn [M, HC*H]``) as

1. ``y = xn @ W_down_inject.T``: the low-rank down rows and the ``HC`` injection rows, one GEMM;
2. ``lowrank = silu(y[:, :R] / HC)`` (``hc_silu``);
3. ``gate = lowrank @ W_up.T`` (``[M, HC*H]``);
4. ``block_input = mean_s sigmoid(gate[:, s]) * xn[:, s]`` over the ``HC`` streams (``hc_gate_mix``),

each rounded to bf16 in between. The release stores ``W_down_inject`` and ``W_up`` as
compressed-tensors INT8 (group 64), whose packed words viewed as bytes are ``q + 128`` in k order,
so the kernels read them with no repack and no extra memory (seed 000 §3.3):

* :func:`hc_down_inject_silu`: steps 1-2, :func:`~.decode_mma.int8_mma` with its SiLU epilogue;
* :func:`hc_up_gate_mix`: steps 3-4; a program owns ``BLOCK_J`` hidden columns and computes their
  gate in all four streams, so the mix happens in registers and ``gate`` is never stored.

The bf16 rounding points are the unfused path's, so with exactly representable inputs the result is
bit-identical to :func:`~.reference.reference_mix` (the unfused path in torch); tests check that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.quant.kernels import configs
from flashnext.quant.kernels._common import INTERPRETED, dot, int8_codes
from flashnext.quant.kernels.decode_mma import MMA_MAX_TOKENS, int8_mma

HC_COUNT = 4  # the streams the fused mix takes (Qwen3.8-Flash-Next's)
# vLLM's GatedResidual pads its merged down/inject projection to a multiple of this many rows
DOWN_INJECT_ROWS = 16


def mixer_shapes(hidden_size: int, hc_count: int, lowrank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``([N, K] of the down/inject projection, [N, K] of the up projection)`` of a mixer that
    injects, as vLLM 0.34.0's ``GatedResidual`` builds them: the low-rank rows and the ``hc_count``
    injection rows, padded (its ``pad_size``), over the streams; the streams over the low rank. (The
    final mixer, which injects nothing, has the low-rank rows alone.)"""
    streams = hc_count * hidden_size
    rows = lowrank + hc_count
    return (rows + (-rows) % DOWN_INJECT_ROWS, streams), (streams, lowrank)


@triton.jit
def _stream_gate(x, w_ptr, s_ptr, rows, j_mask, stride_wn, stride_sn, g, GROUP: tl.constexpr, DOT_FP32: tl.constexpr):
    """One group's contribution to one stream's gate, ``[BLOCK_M, BLOCK_J]``."""
    codes = int8_codes(w_ptr, rows, j_mask, stride_wn, g, GROUP)
    scale = tl.load(s_ptr + rows * stride_sn + g, mask=j_mask, other=0).to(tl.float32)
    return dot(x, codes, DOT_FP32) * scale[None, :]


@triton.jit
def _gated(gate, xn_ptr, tokens, rows, mask, stride_xnm):
    """``sigmoid(bf16(gate)) * xn`` for one stream, in fp32."""
    xn = tl.load(xn_ptr + tokens[:, None] * stride_xnm + rows[None, :], mask=mask, other=0.0)
    return tl.sigmoid(gate.to(tl.bfloat16).to(tl.float32)) * xn.to(tl.float32)  # the up GEMM's bf16 output


@triton.jit(do_not_specialize=["M"])
def _up_gate_mix_kernel(x_ptr, w_ptr, s_ptr, xn_ptr, y_ptr, M, H, K, stride_xm, stride_wn, stride_sn, stride_xnm,
                        stride_ym, HC: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_J: tl.constexpr, DOT_FP32: tl.constexpr):
    # The four streams' gates are computed side by side in each group's iteration (HC == 4: the
    # model's count; other counts go through vLLM's path), so their loads overlap.
    columns = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_mask = columns < H
    tokens = tl.arange(0, BLOCK_M)
    m_mask = tokens < M
    k_offsets = tl.arange(0, GROUP)
    g0 = tl.zeros((BLOCK_M, BLOCK_J), tl.float32)
    g1 = tl.zeros((BLOCK_M, BLOCK_J), tl.float32)
    g2 = tl.zeros((BLOCK_M, BLOCK_J), tl.float32)
    g3 = tl.zeros((BLOCK_M, BLOCK_J), tl.float32)
    for g in range(0, K // GROUP):
        x = tl.load(x_ptr + tokens[:, None] * stride_xm + g * GROUP + k_offsets[None, :], mask=m_mask[:, None],
                    other=0.0)
        g0 += _stream_gate(x, w_ptr, s_ptr, columns, j_mask, stride_wn, stride_sn, g, GROUP, DOT_FP32)
        g1 += _stream_gate(x, w_ptr, s_ptr, H + columns, j_mask, stride_wn, stride_sn, g, GROUP, DOT_FP32)
        g2 += _stream_gate(x, w_ptr, s_ptr, 2 * H + columns, j_mask, stride_wn, stride_sn, g, GROUP, DOT_FP32)
        g3 += _stream_gate(x, w_ptr, s_ptr, 3 * H + columns, j_mask, stride_wn, stride_sn, g, GROUP, DOT_FP32)
    mask = m_mask[:, None] & j_mask[None, :]
    # From zero and in stream order, as hc_gate_mix sums, so that on a GPU each step compiles to the
    # same fused multiply-add as there.
    mixed = tl.zeros((BLOCK_M, BLOCK_J), tl.float32)
    mixed += _gated(g0, xn_ptr, tokens, columns, mask, stride_xnm)
    mixed += _gated(g1, xn_ptr, tokens, H + columns, mask, stride_xnm)
    mixed += _gated(g2, xn_ptr, tokens, 2 * H + columns, mask, stride_xnm)
    mixed += _gated(g3, xn_ptr, tokens, 3 * H + columns, mask, stride_xnm)
    tl.store(y_ptr + tokens[:, None] * stride_ym + columns[None, :], mixed / HC, mask=mask)


def _check_int8(packed: torch.Tensor, scales: torch.Tensor, k: int, what: str) -> int:
    if packed.dtype != torch.int32 or packed.shape[1] * 4 != k or not packed.is_contiguous():
        raise ValueError(f"{what}: packed must be contiguous int32 [N, {k // 4}], got {packed.dtype} "
                         f"{list(packed.shape)}")
    if scales.shape[0] != packed.shape[0] or k % scales.shape[1] or (k // scales.shape[1]) % 16:
        raise ValueError(f"{what}: scales {list(scales.shape)} are no group scaling of [{packed.shape[0]}, {k}]")
    return k // scales.shape[1]


def hc_down_inject_silu(xn: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, lowrank: int,
                        hc_count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 1-2 for 1..16 tokens: ``(silu(y[:, :lowrank] / hc_count), y[:, lowrank:lowrank + hc_count])``
    as bf16 views of one ``[M, N]`` output; the injection is None when ``N == lowrank`` (the final
    mixer, which has no inject rows). Rows past ``lowrank + hc_count`` (alignment padding) are
    computed and ignored, as vLLM does."""
    _check_int8(packed, scales, xn.shape[1], "down/inject")
    # A few hundred rows over a long K launch as their own row of the table, not int8_mma's.
    config = configs.config_for("hc_down_inject", packed.shape[0], xn.shape[1], xn.device)
    y = int8_mma(xn, packed, scales, silu_columns=lowrank, silu_div=hc_count, config=config)
    injection = y[:, lowrank:lowrank + hc_count] if packed.shape[0] > lowrank else None
    return y[:, :lowrank], injection


def hc_up_gate_mix(lowrank: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, xn: torch.Tensor,
                   hc_count: int, block_j: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Steps 3-4 for 1..16 tokens: the block input ``[M, H]`` from ``lowrank [M, R]``, the up
    projection (``int32 [HC*H, R/4]`` words, scales) and ``xn [M, HC*H]``; the launch is
    ``configs``' row unless given."""
    M, K = lowrank.shape
    group = _check_int8(packed, scales, K, "up")
    if not 1 <= M <= MMA_MAX_TOKENS:
        raise ValueError(f"the fused HC mix takes 1..{MMA_MAX_TOKENS} tokens, got {M}")
    if hc_count != HC_COUNT:
        raise ValueError(f"the fused HC mix takes {HC_COUNT} streams (Qwen3.8-Flash-Next's), got {hc_count}")
    if xn.shape != (M, packed.shape[0]) or packed.shape[0] % hc_count or xn.stride(1) != 1 or lowrank.stride(1) != 1:
        raise ValueError(f"xn {list(xn.shape)} does not match the up projection's {packed.shape[0]} rows")
    if xn.dtype != torch.bfloat16 or lowrank.dtype != torch.bfloat16:
        raise ValueError(f"the fused HC mix rounds as vLLM's bf16 path does; got {xn.dtype} activations")
    H = packed.shape[0] // hc_count
    config = configs.config_for("hc_up_gate_mix", packed.shape[0], K, xn.device)
    block_j = block_j or config.block_j
    y = torch.empty(M, H, dtype=xn.dtype, device=xn.device)
    _up_gate_mix_kernel[(triton.cdiv(H, block_j),)](
        lowrank, packed.view(torch.uint8), scales, xn, y, M, H, K, lowrank.stride(0), packed.stride(0) * 4,
        scales.stride(0), xn.stride(0), y.stride(0), HC=hc_count, GROUP=group, BLOCK_M=16, BLOCK_J=block_j,
        DOT_FP32=INTERPRETED, num_warps=num_warps or config.num_warps)
    return y


def hc_mix(xn: torch.Tensor, down: tuple[torch.Tensor, torch.Tensor], up: tuple[torch.Tensor, torch.Tensor],
           lowrank: int, hc_count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole mix (steps 1-4) in two launches: ``(block_input, injection)``."""
    low, injection = hc_down_inject_silu(xn, *down, lowrank, hc_count)
    return hc_up_gate_mix(low, *up, xn, hc_count), injection

