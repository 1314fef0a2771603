"""Decode GEMV over INT6 bit-plane weights (``flashnext.quant.formats.bitplane``), for 1 to 4 tokens.

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

Launch parameters are ``configs``' ``bitplane_gemv`` rows unless a caller passes ``launch=``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.quant.kernels import configs
from flashnext.quant.kernels.configs import GemvConfig

GEMV_MAX_TOKENS = 4  # each token is its own row of every product tile: beyond four, tensor cores win


@triton.jit
def _scaled_groups(prod, s_ptr, rows, n_mask, stride_sn, k0, M_PAD: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, PER_GROUP: tl.constexpr):
    """``prod [M_PAD, BLOCK_N, GROUPS*PER_GROUP]`` summed per group, then scaled once per group."""
    partial = tl.sum(tl.reshape(prod, [M_PAD, BLOCK_N, GROUPS, PER_GROUP]), axis=3)
    g_cols = k0 // GROUP + tl.arange(0, GROUPS)
    s = tl.load(s_ptr + rows[:, None] * stride_sn + g_cols[None, :], mask=n_mask[:, None], other=0).to(tl.float32)
    return tl.sum(partial * s[None, :, :], axis=2)


@triton.jit
def _weight(lo, hi, J: tl.constexpr):
    """Weight ``J`` of eight: nibble ``J`` of the low-plane word, crumb ``J`` of the high-plane word."""
    return ((((lo >> (4 * J)) & 15) | (((hi >> (2 * J)) & 3) << 4)).to(tl.int32) - 32).to(tl.float32)


@triton.jit
def _dot_rows(x_ptr, w_ptr, s_ptr, rows, n_mask, M, K, stride_xm, stride_wn, stride_sn,
              M_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 ``[M_PAD, BLOCK_N]`` dot products of every token with weight ``rows``.

    Weights are decoded four at a time with no shuffles: a little-endian 16-bit load of the low
    plane holds the nibbles of elements 4i..4i+3 and one byte of the high plane their crumbs; the
    activations are read in the same four strided streams instead. (Taking the -32 offset out of
    the loop as sum(u*x) - 32*sum(x) cancels catastrophically in fp32; it is subtracted per weight.)
    """
    QUADS: tl.constexpr = BLOCK_K // 4
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    PER_GROUP: tl.constexpr = GROUP // 4
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    lo_ptr = w_ptr.to(tl.pointer_type(tl.uint16))
    half_words = K // 4  # the high plane starts K/2 bytes = K/4 16-bit words into the row
    tokens = tl.arange(0, M_PAD)
    t_mask = tokens < M
    quad = tl.arange(0, QUADS)
    for k0 in range(0, K, BLOCK_K):
        lo = tl.load(lo_ptr + rows[:, None] * (stride_wn // 2) + (k0 // 4 + quad)[None, :],
                     mask=n_mask[:, None], other=0).to(tl.int32)
        hi = tl.load(w_ptr + rows[:, None] * stride_wn + (2 * half_words + k0 // 4 + quad)[None, :],
                     mask=n_mask[:, None], other=0).to(tl.int32)
        u0 = (((lo & 15) | ((hi & 3) << 4)) - 32).to(tl.float32)
        u1 = ((((lo >> 4) & 15) | (((hi >> 2) & 3) << 4)) - 32).to(tl.float32)
        u2 = ((((lo >> 8) & 15) | (((hi >> 4) & 3) << 4)) - 32).to(tl.float32)
        u3 = ((((lo >> 12) & 15) | ((hi >> 6) << 4)) - 32).to(tl.float32)
        xb = x_ptr + tokens[:, None] * stride_xm + k0 + 4 * quad[None, :]
        x0 = tl.load(xb, mask=t_mask[:, None], other=0).to(tl.float32)
        x1 = tl.load(xb + 1, mask=t_mask[:, None], other=0).to(tl.float32)
        x2 = tl.load(xb + 2, mask=t_mask[:, None], other=0).to(tl.float32)
        x3 = tl.load(xb + 3, mask=t_mask[:, None], other=0).to(tl.float32)
        prod = (u0[None, :, :] * x0[:, None, :] + u1[None, :, :] * x1[:, None, :]
                + u2[None, :, :] * x2[:, None, :] + u3[None, :, :] * x3[:, None, :])
        acc += _scaled_groups(prod, s_ptr, rows, n_mask, stride_sn, k0, M_PAD, GROUP, BLOCK_N, GROUPS, PER_GROUP)
    return acc


@triton.jit
def _dot_rows_wide(x_ptr, w_ptr, s_ptr, rows, n_mask, M, K, stride_xm, stride_wn, stride_sn,
                   M_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`_dot_rows` with eight weights per load: a 32-bit word of the low plane and a 16-bit
    word of the high plane, and the activations read as one contiguous vector split into eight
    strided streams in registers. Fewer, wider L1 accesses (the quad kernel is L1-bound, not DRAM-
    bound, at large shapes); needs K % 16 == 0 so that every row's words are aligned."""
    OCTS: tl.constexpr = BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    PER_GROUP: tl.constexpr = GROUP // 8
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    lo_ptr = w_ptr.to(tl.pointer_type(tl.uint32))
    hi_ptr = w_ptr.to(tl.pointer_type(tl.uint16))
    tokens = tl.arange(0, M_PAD)
    t_mask = tokens < M
    octs = tl.arange(0, OCTS)
    for k0 in range(0, K, BLOCK_K):
        lo = tl.load(lo_ptr + rows[:, None] * (stride_wn // 4) + (k0 // 8 + octs)[None, :],
                     mask=n_mask[:, None], other=0)
        hi = tl.load(hi_ptr + rows[:, None] * (stride_wn // 2) + (K // 4 + k0 // 8 + octs)[None, :],
                     mask=n_mask[:, None], other=0).to(tl.uint32)
        xv = tl.load(x_ptr + tokens[:, None] * stride_xm + k0 + tl.arange(0, BLOCK_K)[None, :],
                     mask=t_mask[:, None], other=0).to(tl.float32)
        c0, c1 = tl.split(tl.reshape(xv, [M_PAD, OCTS, 2, 2, 2]))  # [.., a, b, c]: element 8o + 4a + 2b + c
        b00, b01 = tl.split(c0)
        b10, b11 = tl.split(c1)
        x0, x4 = tl.split(b00)
        x2, x6 = tl.split(b01)
        x1, x5 = tl.split(b10)
        x3, x7 = tl.split(b11)
        prod = (_weight(lo, hi, 0)[None] * x0[:, None] + _weight(lo, hi, 1)[None] * x1[:, None]
                + _weight(lo, hi, 2)[None] * x2[:, None] + _weight(lo, hi, 3)[None] * x3[:, None]
                + _weight(lo, hi, 4)[None] * x4[:, None] + _weight(lo, hi, 5)[None] * x5[:, None]
                + _weight(lo, hi, 6)[None] * x6[:, None] + _weight(lo, hi, 7)[None] * x7[:, None])
        acc += _scaled_groups(prod, s_ptr, rows, n_mask, stride_sn, k0, M_PAD, GROUP, BLOCK_N, GROUPS, PER_GROUP)
    return acc


@triton.jit
def _dot(x_ptr, w_ptr, s_ptr, rows, n_mask, M, K, stride_xm, stride_wn, stride_sn,
         M_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         WIDE: tl.constexpr):
    if WIDE:
        return _dot_rows_wide(x_ptr, w_ptr, s_ptr, rows, n_mask, M, K, stride_xm, stride_wn, stride_sn,
                              M_PAD, GROUP, BLOCK_N, BLOCK_K)
    else:
        return _dot_rows(x_ptr, w_ptr, s_ptr, rows, n_mask, M, K, stride_xm, stride_wn, stride_sn,
                         M_PAD, GROUP, BLOCK_N, BLOCK_K)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                 M_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 WIDE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    tokens = tl.arange(0, M_PAD)
    acc = _dot(x_ptr, w_ptr, s_ptr, rows, n_mask, M, K, stride_xm, stride_wn, stride_sn,
               M_PAD, GROUP, BLOCK_N, BLOCK_K, WIDE)
    mask = (tokens < M)[:, None] & n_mask[None, :]
    tl.store(y_ptr + tokens[:, None] * stride_ym + rows[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, I, K, stride_xm, stride_wn, stride_sn, stride_ym,
                    M_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    WIDE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < I
    tokens = tl.arange(0, M_PAD)
    g = _dot(x_ptr, w_ptr, s_ptr, rows, n_mask, M, K, stride_xm, stride_wn, stride_sn,
             M_PAD, GROUP, BLOCK_N, BLOCK_K, WIDE)
    u = _dot(x_ptr, w_ptr, s_ptr, rows + I, n_mask, M, K, stride_xm, stride_wn, stride_sn,
             M_PAD, GROUP, BLOCK_N, BLOCK_K, WIDE)
    # bf16 rounding where the unfused path rounds: after each GEMM
    g = g.to(y_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(y_ptr.dtype.element_ty).to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * u
    mask = (tokens < M)[:, None] & n_mask[None, :]
    tl.store(y_ptr + tokens[:, None] * stride_ym + rows[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_combine_kernel(x_ptr, w_ptr, s_ptr, routed_ptr, gate_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
                         stride_sn, stride_rm, stride_ym, M_PAD: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    tokens = tl.arange(0, M_PAD)
    acc = _dot(x_ptr, w_ptr, s_ptr, rows, n_mask, M, K, stride_xm, stride_wn, stride_sn,
               M_PAD, GROUP, BLOCK_N, BLOCK_K, WIDE)
    shared = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    mask = (tokens < M)[:, None] & n_mask[None, :]
    gate = tl.load(gate_ptr + tokens, mask=tokens < M, other=0).to(tl.float32)
    routed = tl.load(routed_ptr + tokens[:, None] * stride_rm + rows[None, :], mask=mask, other=0).to(tl.float32)
    out = routed + shared / (1.0 + tl.exp(-gate))[:, None]
    tl.store(y_ptr + tokens[:, None] * stride_ym + rows[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor) -> tuple[int, int, int]:
    M, K = x.shape
    N = planes.shape[0]
    if not 1 <= M <= GEMV_MAX_TOKENS:
        raise ValueError(f"bit-plane GEMV takes 1..{GEMV_MAX_TOKENS} tokens, got {M}")
    if K % 8:
        raise ValueError(f"K={K}: the kernel reads the low plane in 16-bit words and needs K % 8 == 0")
    if planes.dtype != torch.uint8 or planes.shape[1] * 4 != K * 3:
        raise ValueError(f"planes must be uint8 [N, 3K/4] for K={K}, got {planes.dtype} {list(planes.shape)}")
    group = K // scales.shape[1]
    if scales.shape[0] != N or group * scales.shape[1] != K:
        raise ValueError(f"scales {list(scales.shape)} do not fit [{N}, {K}]")
    return M, N, K


def _config(N: int, K: int, device, launch: GemvConfig | None) -> GemvConfig:
    return launch or configs.config_for("bitplane_gemv", N, K, device)


def _launch(N: int, K: int, group: int, M: int, cfg: GemvConfig) -> dict:
    for bk in (cfg.block_k, 512, 256, 128, 64):
        if K % bk == 0 and bk % group == 0:
            break
    else:
        raise ValueError(f"K={K} with group {group}: need K divisible by a block of 64..512 that holds whole groups")
    return {"M_PAD": triton.next_power_of_2(M), "GROUP": group, "BLOCK_N": cfg.block_n, "BLOCK_K": bk,
            "WIDE": cfg.wide and K % 16 == 0, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def bitplane_gemv(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor,
                  launch: GemvConfig | None = None) -> torch.Tensor:
    """``x @ W.T`` for 1..4 tokens on CUDA cores. :func:`bitplane_matmul` picks between this and
    the tensor-core kernel for 1..16 tokens."""
    M, N, K = _check(x, planes, scales)
    group = K // scales.shape[1]
    cfg = _config(N, K, x.device, launch)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](x, planes, scales, y, M, N, K, x.stride(0), planes.stride(0),
                                                 scales.stride(0), y.stride(0), **_launch(N, K, group, M, cfg))
    return y


def bitplane_gate_up_silu(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor,
                          launch: GemvConfig | None = None) -> torch.Tensor:
    M, N2, K = _check(x, planes, scales)
    if N2 % 2:
        raise ValueError("merged gate/up weights need an even number of rows")
    I = N2 // 2
    group = K // scales.shape[1]
    cfg = _config(N2, K, x.device, launch)
    y = torch.empty(M, I, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    _gate_up_kernel[(triton.cdiv(I, cfg.block_n),)](x, planes, scales, y, M, I, K, x.stride(0), planes.stride(0),
                                                    scales.stride(0), y.stride(0), **_launch(N2, K, group, M, cfg))
    return y


def bitplane_down_combine(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor, routed: torch.Tensor,
                          gate: torch.Tensor, launch: GemvConfig | None = None) -> torch.Tensor:
    M, N, K = _check(x, planes, scales)
    group = K // scales.shape[1]
    if routed.shape != (M, N) or gate.numel() != M:
        raise ValueError(f"routed must be [{M}, {N}] and gate [{M}, 1]")
    cfg = _config(N, K, x.device, launch)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    x, routed, gate = x.contiguous(), routed.contiguous(), gate.contiguous().view(-1)
    _down_combine_kernel[(triton.cdiv(N, cfg.block_n),)](x, planes, scales, routed, gate, y, M, N, K, x.stride(0),
                                                         planes.stride(0), scales.stride(0), routed.stride(0),
                                                         y.stride(0), **_launch(N, K, group, M, cfg))
    return y
