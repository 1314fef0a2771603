"""Decode GEMV over INT6 bit-plane weights (``flashnext.quant.bitplane``), for 1 to 4 tokens.

``y[m, n] = sum_k x[m, k] * (q[n, k] * s[n, k // group])`` with ``q = ((hi << 4) | lo) - 32`` read
from the two planes with plain shifts: the low plane gives two values per byte, the high plane
four. Each program owns ``BLOCK_N`` output rows and walks K; per group of ``GROUP`` inputs the
partial dot products are reduced first and scaled once, in fp32.

Variants, as seed 000 §3.3 fuses the shared expert:

* :func:`bitplane_gemv`: ``y = x @ W.T``;
* :func:`bitplane_gate_up_silu`: ``W`` is the merged gate/up ``[2I, K]`` (rows ``[0, I)`` gate,
  ``[I, 2I)`` up); returns ``silu(x @ Wg.T) * (x @ Wu.T)``, ``[M, I]``;
* :func:`bitplane_down_combine`: returns ``routed + sigmoid(gate) * (x @ Wd.T)``, the MoE block's
  final sum with the shared expert's gate logit ``gate [M, 1]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TOKENS = 4


@triton.jit
def _dot_rows(x_ptr, w_ptr, s_ptr, rows, n_mask, m: tl.constexpr, K, stride_xm, stride_wn, stride_sn,
              GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 ``[BLOCK_N]`` dot products of token ``m`` with weight ``rows``."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    half = K // 2
    for k0 in range(0, K, BLOCK_K):
        lo_cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        hi_cols = half + k0 // 4 + tl.arange(0, BLOCK_K // 4)
        lo = tl.load(w_ptr + rows[:, None] * stride_wn + lo_cols[None, :], mask=n_mask[:, None], other=0)
        hi = tl.load(w_ptr + rows[:, None] * stride_wn + hi_cols[None, :], mask=n_mask[:, None], other=0)
        lo = lo.to(tl.int32)
        hi = hi.to(tl.int32)
        nib = tl.reshape(tl.join(lo & 15, lo >> 4), [BLOCK_N, BLOCK_K])
        crumb = tl.reshape(tl.join(tl.join(hi & 3, (hi >> 4) & 3), tl.join((hi >> 2) & 3, hi >> 6)),
                           [BLOCK_N, BLOCK_K])
        q = ((crumb << 4) | nib) - 32
        x = tl.load(x_ptr + m * stride_xm + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)
        prod = tl.reshape(q.to(tl.float32) * x[None, :], [BLOCK_N, GROUPS, GROUP])
        partial = tl.sum(prod, axis=2)
        g_cols = k0 // GROUP + tl.arange(0, GROUPS)
        s = tl.load(s_ptr + rows[:, None] * stride_sn + g_cols[None, :], mask=n_mask[:, None], other=0).to(tl.float32)
        acc += tl.sum(partial * s, axis=1)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                 M: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    for m in tl.static_range(M):
        acc = _dot_rows(x_ptr, w_ptr, s_ptr, rows, n_mask, m, K, stride_xm, stride_wn, stride_sn,
                        GROUP, BLOCK_N, BLOCK_K)
        tl.store(y_ptr + m * stride_ym + rows, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, y_ptr, I, K, stride_xm, stride_wn, stride_sn, stride_ym,
                    M: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < I
    for m in tl.static_range(M):
        g = _dot_rows(x_ptr, w_ptr, s_ptr, rows, n_mask, m, K, stride_xm, stride_wn, stride_sn,
                      GROUP, BLOCK_N, BLOCK_K)
        u = _dot_rows(x_ptr, w_ptr, s_ptr, rows + I, n_mask, m, K, stride_xm, stride_wn, stride_sn,
                      GROUP, BLOCK_N, BLOCK_K)
        # bf16 rounding where the unfused path rounds: after each GEMM
        g = g.to(y_ptr.dtype.element_ty).to(tl.float32)
        u = u.to(y_ptr.dtype.element_ty).to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * u
        tl.store(y_ptr + m * stride_ym + rows, out.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_combine_kernel(x_ptr, w_ptr, s_ptr, routed_ptr, gate_ptr, y_ptr, N, K, stride_xm, stride_wn,
                         stride_sn, stride_rm, stride_ym, M: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    for m in tl.static_range(M):
        acc = _dot_rows(x_ptr, w_ptr, s_ptr, rows, n_mask, m, K, stride_xm, stride_wn, stride_sn,
                        GROUP, BLOCK_N, BLOCK_K)
        shared = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        gate = tl.load(gate_ptr + m).to(tl.float32)
        routed = tl.load(routed_ptr + m * stride_rm + rows, mask=n_mask, other=0).to(tl.float32)
        out = routed + shared / (1.0 + tl.exp(-gate))
        tl.store(y_ptr + m * stride_ym + rows, out.to(y_ptr.dtype.element_ty), mask=n_mask)


def _check(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int]:
    M, K = x.shape
    N = planes.shape[0]
    if not 1 <= M <= MAX_TOKENS:
        raise ValueError(f"bit-plane GEMV takes 1..{MAX_TOKENS} tokens, got {M}")
    if planes.dtype != torch.uint8 or planes.shape[1] * 4 != K * 3:
        raise ValueError(f"planes must be uint8 [N, 3K/4] for K={K}, got {planes.dtype} {list(planes.shape)}")
    group = K // scales.shape[1]
    if scales.shape[0] != N or group * scales.shape[1] != K:
        raise ValueError(f"scales {list(scales.shape)} do not fit [{N}, {K}]")
    return M, N, K


def _block_k(K: int, group: int) -> int:
    for bk in (512, 256, 128, 64):
        if K % bk == 0 and bk % group == 0:
            return bk
    raise ValueError(f"K={K} with group {group}: need K divisible by a block of 64..512 that holds whole groups")


BLOCK_N = 16


def bitplane_gemv(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    M, N, K = _check(x, planes, scales)
    group = K // scales.shape[1]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    _gemv_kernel[(triton.cdiv(N, BLOCK_N),)](x, planes, scales, y, N, K, x.stride(0), planes.stride(0),
                                           scales.stride(0), y.stride(0), M=M, GROUP=group, BLOCK_N=BLOCK_N,
                                           BLOCK_K=_block_k(K, group))
    return y


def bitplane_gate_up_silu(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    M, N2, K = _check(x, planes, scales)
    if N2 % 2:
        raise ValueError("merged gate/up weights need an even number of rows")
    I = N2 // 2
    group = K // scales.shape[1]
    y = torch.empty(M, I, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    _gate_up_kernel[(triton.cdiv(I, BLOCK_N),)](x, planes, scales, y, I, K, x.stride(0), planes.stride(0),
                                              scales.stride(0), y.stride(0), M=M, GROUP=group, BLOCK_N=BLOCK_N,
                                              BLOCK_K=_block_k(K, group))
    return y


def bitplane_down_combine(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor, routed: torch.Tensor,
                          gate: torch.Tensor) -> torch.Tensor:
    M, N, K = _check(x, planes, scales)
    group = K // scales.shape[1]
    if routed.shape != (M, N) or gate.numel() != M:
        raise ValueError(f"routed must be [{M}, {N}] and gate [{M}, 1]")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    x, routed, gate = x.contiguous(), routed.contiguous(), gate.contiguous().view(-1)
    _down_combine_kernel[(triton.cdiv(N, BLOCK_N),)](x, planes, scales, routed, gate, y, N, K, x.stride(0),
                                                   planes.stride(0), scales.stride(0), routed.stride(0), y.stride(0),
                                                   M=M, GROUP=group, BLOCK_N=BLOCK_N, BLOCK_K=_block_k(K, group))
    return y
