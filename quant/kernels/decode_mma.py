"""Tensor-core GEMM for decode batches (1 to 16 tokens) over group-quantized integer weights.

``y[m, n] = sum_k x[m, k] * (q[n, k] * s[n, k // group])`` for two weight formats:

* INT6 in the bit-plane layout of :mod:`flashnext.quant.formats.bitplane` (:func:`bitplane_mma`;
  :func:`bitplane_matmul` picks it or the CUDA-core GEMV of :mod:`.bitplane_gemv`);
* INT8 as compressed-tensors packs it (``pack-quantized``, 8 bits: four ``q + 128`` bytes per
  little-endian int32, so the words viewed as bytes are the codes in k order) (:func:`int8_mma`).

Each program owns ``BLOCK_N`` output rows and a range of K (split-K), walked in steps. Per step it
loads the rows' bytes with wide loads, rebuilds the codes in k order in registers, and multiplies
them against the tokens (padded to 16) with ``tl.dot``, accumulating in fp32:

* INT8, one group a step: the codes as exact bf16 integers, the fp32 product scaled once per
  group, so the only rounding is the output's;
* INT6, four groups a step (256 columns): the weights dequantized to ``bf16(q * s)`` before the
  dot, the weights a dense bf16 checkpoint would hold. One wide dot per step instead of one per
  group made the kernel 10-20% faster on the H200 (docs/benchmarks.md).

Split-K partials go to an fp32 workspace; the last program of a row block (an acq_rel counter)
sums them and writes the output, then resets its counter, so one launch does the whole GEMM.

The output can go through one epilogue on the way out, for the hyper-connection's down projection
(decode-04, :mod:`.hc_mix`): the first ``silu_columns`` outputs become ``silu(bf16(y) / silu_div)``,
rounded where vLLM's unfused ``hc_silu`` rounds.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_TOKENS = 16
# Triton 3.8's interpreter multiplies bf16 dot operands as raw integers (see qsa_row_cache).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _bitplane_weights(w_ptr, s_ptr, rows, n_mask, stride_wn, stride_sn, step, K, GROUP: tl.constexpr,
                      STEP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Step ``step``'s dequantized weights ``q * s`` for ``rows``, fp32 ``[BLOCK_N, STEP]`` in k order
    (:func:`_dot` rounds them to bf16 on the GPU).

    The planes are read with wide loads and the codes rebuilt in registers with ``tl.join``; each
    group's scale is applied before the dot (as Marlin does), so one ``tl.dot`` covers STEP columns.
    """
    half = tl.arange(0, STEP // 2)
    quarter = tl.arange(0, STEP // 4)
    row_base = w_ptr + rows[:, None].to(tl.int64) * stride_wn
    lo = tl.load(row_base + step * (STEP // 2) + half[None, :], mask=n_mask[:, None], other=0).to(tl.int32)
    hi = tl.load(row_base + K // 2 + step * (STEP // 4) + quarter[None, :], mask=n_mask[:, None],
                 other=0).to(tl.int32)
    low = tl.reshape(tl.join(lo & 15, lo >> 4), [BLOCK_N, STEP])
    high = tl.reshape(tl.join(tl.join(hi & 3, (hi >> 4) & 3), tl.join((hi >> 2) & 3, hi >> 6)), [BLOCK_N, STEP])
    codes = ((low | (high << 4)) - 32).to(tl.float32)
    GROUPS: tl.constexpr = STEP // GROUP
    s = tl.load(s_ptr + rows[:, None] * stride_sn + step * GROUPS + tl.arange(0, GROUPS)[None, :],
                mask=n_mask[:, None], other=0).to(tl.float32)
    return tl.reshape(tl.reshape(codes, [BLOCK_N, GROUPS, GROUP]) * s[:, :, None], [BLOCK_N, STEP])


@triton.jit
def _int8_codes(w_ptr, rows, n_mask, stride_wn, g, GROUP: tl.constexpr):
    """Group ``g``'s INT8 codes for ``rows`` from compressed-tensors' packed words, viewed as bytes."""
    columns = tl.arange(0, GROUP)
    row_base = w_ptr + rows[:, None].to(tl.int64) * stride_wn
    return tl.load(row_base + g * GROUP + columns[None, :], mask=n_mask[:, None], other=128).to(tl.int32) - 128


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """``a @ b.T`` in bf16, accumulated in fp32; in fp32 under the interpreter, whose bf16 dot is wrong."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
    return tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)))


@triton.jit
def _epilogue(y, rows, SILU_COLUMNS: tl.constexpr, SILU_DIV: tl.constexpr):
    """``y`` as stored: unchanged, or with the first ``SILU_COLUMNS`` outputs through the HC SiLU."""
    if SILU_COLUMNS == 0:
        return y
    v = y.to(tl.bfloat16).to(tl.float32) / SILU_DIV  # the GEMM's bf16 output is what hc_silu reads
    return tl.where((rows < SILU_COLUMNS)[None, :], v * tl.sigmoid(v), y)


@triton.jit(do_not_specialize=["M"])
def _mma_kernel(x_ptr, w_ptr, s_ptr, y_ptr, partial_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                stride_ym, GROUP: tl.constexpr, STEP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr, BITS: tl.constexpr,
                SILU_COLUMNS: tl.constexpr = 0, SILU_DIV: tl.constexpr = 1):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    tokens = tl.arange(0, BLOCK_M)
    m_mask = tokens < M
    columns = tl.arange(0, STEP)
    num_steps = K // STEP
    first = pid_k * num_steps // SPLIT_K
    last = (pid_k + 1) * num_steps // SPLIT_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for step in range(first, last):
        x = tl.load(x_ptr + tokens[:, None] * stride_xm + step * STEP + columns[None, :], mask=m_mask[:, None],
                    other=0.0)
        if BITS == 8:  # STEP == GROUP: exact integer products, scaled once per group
            codes = _int8_codes(w_ptr, rows, n_mask, stride_wn, step, GROUP)
            scale = tl.load(s_ptr + rows * stride_sn + step, mask=n_mask, other=0).to(tl.float32)
            acc += _dot(x, codes, DOT_FP32) * scale[None, :]
        else:
            weights = _bitplane_weights(w_ptr, s_ptr, rows, n_mask, stride_wn, stride_sn, step, K, GROUP, STEP,
                                        BLOCK_N)
            acc += _dot(x, weights, DOT_FP32)
    out_mask = m_mask[:, None] & n_mask[None, :]
    out_ptr = y_ptr + tokens[:, None] * stride_ym + rows[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr, _epilogue(acc, rows, SILU_COLUMNS, SILU_DIV), mask=out_mask)
    else:
        part = partial_ptr + (pid_k * BLOCK_M + tokens[:, None]) * N + rows[None, :]
        tl.store(part, acc, mask=out_mask)
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in range(SPLIT_K):  # in split order, so the sum does not depend on who finished last
                total += tl.load(partial_ptr + (s * BLOCK_M + tokens[:, None]) * N + rows[None, :], mask=out_mask,
                                 other=0.0, cache_modifier=".cg")
            tl.store(out_ptr, _epilogue(total, rows, SILU_COLUMNS, SILU_DIV), mask=out_mask)
            tl.store(count_ptr + pid_n, 0)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(n: int, device) -> torch.Tensor:
    """Zeroed split-K counters, reset by the kernel after each use."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < n:
        have = _COUNTERS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return have


# INT6 columns per step: four groups of 64 (the H200 sweep's best, docs/benchmarks.md 2026-12-01).
BITPLANE_STEP = 256


def bitplane_step(K: int, group: int) -> int:
    """The widest of 256 and 128 columns that holds whole groups and divides K, else one group."""
    for step in (BITPLANE_STEP, 128):
        if K % step == 0 and step % group == 0:
            return step
    return group


def launch_shape(N: int, K: int, step: int, bits: int, sms: int = 132) -> tuple[int, int]:
    """(BLOCK_N, SPLIT_K), from the H200 sweeps in docs/benchmarks.md.

    INT8: 64-row blocks, split over K until about two programs per SM. INT6: 64-row blocks from 2^26
    weights and 32 below, split into at least two parts and until about two programs per SM.
    """
    block_n = 64 if bits == 8 or N * K >= 1 << 26 else 32
    blocks = triton.cdiv(N, block_n)
    split = triton.cdiv(2 * sms, blocks)
    if bits == 6:
        split = max(2, split)
    return block_n, max(1, min(K // step, split))


def _mma(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, bits: int, block_n: int | None,
         split_k: int | None, num_warps: int, num_stages: int, silu_columns: int = 0,
         silu_div: int = 1) -> torch.Tensor:
    M, K = x.shape
    N = weights.shape[0]
    if not 1 <= M <= MAX_TOKENS:
        raise ValueError(f"the decode GEMM takes 1..{MAX_TOKENS} tokens, got {M}")
    group = K // scales.shape[1]
    if scales.shape[0] != N or group * scales.shape[1] != K or group % 16:
        raise ValueError(f"scales {list(scales.shape)} do not fit [{N}, {K}] in groups of a multiple of 16")
    step = bitplane_step(K, group) if bits == 6 else group
    auto_n, auto_split = launch_shape(N, K, step, bits, _sms(x.device))
    block_n, split = block_n or auto_n, min(split_k or auto_split, K // step)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(N, block_n)
    partial = torch.empty((split, 16, N), dtype=torch.float32, device=x.device) if split > 1 else y
    _mma_kernel[(blocks, split)](x, weights, scales, y, partial, _counters(blocks, x.device), M, N, K, x.stride(0),
                                 weights.stride(0), scales.stride(0), y.stride(0), GROUP=group, STEP=step,
                                 BLOCK_M=16, BLOCK_N=block_n, SPLIT_K=split, DOT_FP32=INTERPRETED, BITS=bits,
                                 SILU_COLUMNS=silu_columns, SILU_DIV=silu_div, num_warps=num_warps,
                                 num_stages=num_stages)
    return y


def bitplane_mma(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor, block_n: int | None = None,
                 split_k: int | None = None, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """``x @ W.T`` over INT6 bit-plane weights ``uint8 [N, 3K/4]`` and scales ``[N, K / group]``."""
    K = x.shape[1]
    if planes.dtype != torch.uint8 or planes.shape[1] * 4 != K * 3:
        raise ValueError(f"planes must be uint8 [N, 3K/4] for K={K}, got {planes.dtype} {list(planes.shape)}")
    return _mma(x, planes, scales, 6, block_n, split_k, num_warps, num_stages)


def int8_mma(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, block_n: int | None = None,
             split_k: int | None = None, num_warps: int = 4, num_stages: int = 3, silu_columns: int = 0,
             silu_div: int = 1) -> torch.Tensor:
    """``x @ W.T`` over compressed-tensors INT8 ``weight_packed`` (``int32 [N, K/4]``) and scales;
    ``silu_columns`` > 0 applies the HC SiLU epilogue (module docstring) to that many outputs."""
    K = x.shape[1]
    if packed.dtype != torch.int32 or packed.shape[1] * 4 != K or not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous int32 [N, K/4] for K={K}, got {packed.dtype} {list(packed.shape)}")
    return _mma(x, packed.view(torch.uint8), scales, 8, block_n, split_k, num_warps, num_stages, silu_columns,
                silu_div)


# The CUDA-core GEMV wins for one token everywhere, and for up to four on matrices this small
# (2560 x 640); the tensor-core kernel wins otherwise (docs/benchmarks.md, 2026-12-01).
GEMV_SMALL_MATRIX = 1 << 22


def bitplane_matmul(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for 1..16 tokens over bit-plane weights, with the kernel that measured faster."""
    from flashnext.quant.kernels.bitplane_gemv import MAX_TOKENS as GEMV_MAX_TOKENS
    from flashnext.quant.kernels.bitplane_gemv import bitplane_gemv

    M, K = x.shape
    N = planes.shape[0]
    if M == 1 or (M <= GEMV_MAX_TOKENS and N * K < GEMV_SMALL_MATRIX):
        return bitplane_gemv(x, planes, scales)
    return bitplane_mma(x, planes, scales)


def warm_bitplane_matmul(planes: torch.Tensor, scales: torch.Tensor) -> None:
    """Launch, once and on zeros, the kernel variant :func:`bitplane_matmul` takes for 5..16 tokens
    over this weight: the tensor-core kernel, whose variant does not depend on the token count.

    CUDA graphs are captured for 1, 2 and 4 tokens (the profiles' ``cudagraph_capture_sizes``);
    a layer that takes the GEMV there (a small one, or a shared expert that decode-05 runs through
    the fused GEMVs) would otherwise compile and load the tensor-core kernel at its first eager step
    of 5..16 tokens, in the middle of serving and outside vLLM's memory budget (seed 000 §5). Called
    when the weights are loaded, before vLLM measures free memory."""
    K = planes.shape[1] * 4 // 3
    bitplane_matmul(torch.zeros(MAX_TOKENS, K, dtype=scales.dtype, device=planes.device), planes, scales)


def _sms(device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
