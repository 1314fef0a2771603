"""Whole weights dequantized on the GPU, for a prefill GEMM by cuBLAS.

At prefill a layer multiplies hundreds of tokens, and a bf16 GEMM over the dequantized weight is
compute-bound while the dequantization is one pass over the weight. These kernels make that pass
(one program per 64 rows and one step of columns, with the decode kernels' own helpers) and write
each weight ``bf16(q * s)``, rounded once, exactly as :func:`~flashnext.quant.formats.packing.dequantize_groups`
does on the host. Which prefill path a layer takes (this, or the tiled ``tl.dot`` GEMM of
:mod:`.prefill_gemm`) is the launch table's ``prefill`` row for the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.quant.kernels._common import INTERPRETED, bitplane_weights, int8_codes

BLOCK_N = 64


@triton.jit
def _bitplane_dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                                GROUP: tl.constexpr, STEP: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    step = tl.program_id(1)
    n_mask = rows < N
    weights = bitplane_weights(w_ptr, s_ptr, rows, n_mask, stride_wn, stride_sn, step, K, GROUP, STEP, BLOCK_N)
    columns = step * STEP + tl.arange(0, STEP)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_on + columns[None, :],
             weights.to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


@triton.jit
def _int8_dequantize_kernel(w_ptr, s_ptr, out_ptr, N, stride_wn, stride_sn, stride_on,
                            GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    n_mask = rows < N
    codes = int8_codes(w_ptr, rows, n_mask, stride_wn, g, GROUP).to(tl.float32)
    scale = tl.load(s_ptr + rows * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
    columns = g * GROUP + tl.arange(0, GROUP)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_on + columns[None, :],
             (codes * scale[:, None]).to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


def _output(N: int, K: int, dtype: torch.dtype, device) -> torch.Tensor:
    # Triton's interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest even), so
    # interpreted runs write fp32 and let torch round: the same bits the GPU writes.
    return torch.empty(N, K, dtype=torch.float32 if INTERPRETED else dtype, device=device)


def bitplane_dequantize(planes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weights ``[N, K]`` in ``dtype`` of INT6 bit planes ``uint8 [N, 3K/4]`` with group scales
    ``[N, K / group]``.

    >>> w = bitplane_dequantize(layer.weight_packed, layer.weight_scale, torch.bfloat16)  # doctest: +SKIP
    """
    N, K = planes.shape[0], planes.shape[1] * 4 // 3
    group = K // scales.shape[1]
    step = max(group, 64)
    if K % step:
        raise ValueError(f"K {K} is not a multiple of the dequantization step {step}")
    out = _output(N, K, dtype, planes.device)
    if N:
        _bitplane_dequantize_kernel[(triton.cdiv(N, BLOCK_N), K // step)](
            planes, scales, out, N, K, planes.stride(0), scales.stride(0), out.stride(0),
            GROUP=group, STEP=step, BLOCK_N=BLOCK_N)
    return out.to(dtype)


def int8_dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weights ``[N, K]`` in ``dtype`` of compressed-tensors INT8 words ``int32 [N, K/4]`` with
    group scales ``[N, K / group]``.

    >>> w = int8_dequantize(layer.weight_packed, layer.weight_scale, torch.bfloat16)  # doctest: +SKIP
    """
    N, K = packed.shape[0], packed.shape[1] * 4
    group = K // scales.shape[1]
    out = _output(N, K, dtype, packed.device)
    if N:
        words = packed.view(torch.uint8)
        _int8_dequantize_kernel[(triton.cdiv(N, BLOCK_N), K // group)](
            words, scales, out, N, words.stride(0), scales.stride(0), out.stride(0), GROUP=group, BLOCK_N=BLOCK_N)
    return out.to(dtype)
