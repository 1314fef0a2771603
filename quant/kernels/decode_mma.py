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

import math

import torch
import triton
import triton.language as tl

from flashnext.quant.formats.packing import dequantize_groups, unpack_int32
from flashnext.quant.kernels import _common, configs
from flashnext.quant.kernels._common import INTERPRETED, splitk_counters, step_product
from flashnext.quant.kernels.bitplane_gemv import GEMV_MAX_TOKENS, bitplane_gemv
from flashnext.quant.kernels.dequantize import bitplane_dequantize, int8_dequantize
from flashnext.quant.kernels.prefill_gemm import bitplane_gemm, fills_device, int8_gemm

MMA_MAX_TOKENS = 16  # the tokens padded to one 16-row tl.dot operand


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
        acc += step_product(x, w_ptr, s_ptr, rows, n_mask, stride_wn, stride_sn, step, K, GROUP, STEP, BLOCK_N,
                            DOT_FP32, BITS)
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


def partials_shape(split: int, N: int) -> tuple[int, int, int]:
    """The fp32 split-K partials a launch split ``split`` ways writes (none when 1): every program
    its 16 token rows of the ``N`` outputs."""
    return split, MMA_MAX_TOKENS, N


def _splitk_partials(split: int, N: int, device) -> torch.Tensor | None:
    return torch.empty(partials_shape(split, N), dtype=torch.float32, device=device) if split > 1 else None


def _step(config: configs.MmaConfig, K: int, group: int, bits: int) -> int:
    return config.step(K, group) if bits == 6 else group


def mma_scratch_bytes(kernel: str, N: int, K: int, group: int, family: str = configs.DEFAULT) -> tuple[int, int]:
    """What one call over an ``[N, K]`` weight in groups of ``group`` allocates beyond its output,
    launched as ``configs``' ``kernel`` row (``bitplane_mma``: INT6 planes; ``int8_mma`` or
    ``hc_down_inject``: INT8 words) for ``family``: ``(its fp32 split-K partials at the most splits
    any device gives it (the row's fixed split, else one a K step, as the split follows the SMs),
    freed when it returns; the split-K counters its launches need, _common.splitk_counters: made at
    the first launch on a device and kept, shared by every call there)``. ``flashnext plan``'s
    ledger counts them from here."""
    config = configs.config_for(kernel, N, K, family=family)
    steps = K // _step(config, K, group, 6 if kernel == "bitplane_mma" else 8)
    split = max(1, min(config.split_k, steps) if config.split_k else steps)
    partials = 4 * math.prod(partials_shape(split, N)) if split > 1 else 0
    return partials, 4 * max(triton.cdiv(N, config.block_n), _common.SPLITK_COUNTERS)


def _mma(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, bits: int, config: configs.MmaConfig,
         silu_columns: int = 0, silu_div: int = 1) -> torch.Tensor:
    M, K = x.shape
    N = weights.shape[0]
    if not 1 <= M <= MMA_MAX_TOKENS:
        raise ValueError(f"the decode GEMM takes 1..{MMA_MAX_TOKENS} tokens, got {M}")
    group = K // scales.shape[1]
    if scales.shape[0] != N or group * scales.shape[1] != K or group % 16:
        raise ValueError(f"scales {list(scales.shape)} do not fit [{N}, {K}] in groups of a multiple of 16")
    step = _step(config, K, group, bits)
    block_n = config.block_n
    blocks = triton.cdiv(N, block_n)
    split = config.splits(blocks, K // step, _common.sm_count(x.device))
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    partial = _splitk_partials(split, N, x.device)
    counters = splitk_counters(x.device, blocks, "decode_mma")
    _mma_kernel[(blocks, split)](x, weights, scales, y, y if partial is None else partial, counters, M, N, K,
                                 x.stride(0), weights.stride(0), scales.stride(0), y.stride(0), GROUP=group,
                                 STEP=step, BLOCK_M=MMA_MAX_TOKENS, BLOCK_N=block_n, SPLIT_K=split,
                                 DOT_FP32=INTERPRETED, BITS=bits,
                                 SILU_COLUMNS=silu_columns, SILU_DIV=silu_div, num_warps=config.num_warps,
                                 num_stages=config.num_stages)
    return y


def bitplane_mma(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor, block_n: int | None = None,
                 split_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 config: configs.MmaConfig | None = None) -> torch.Tensor:
    """``x @ W.T`` over INT6 bit-plane weights ``uint8 [N, 3K/4]`` and scales ``[N, K / group]``;
    the launch is ``configs``' row for the shape and device unless given."""
    K = x.shape[1]
    if planes.dtype != torch.uint8 or planes.shape[1] * 4 != K * 3:
        raise ValueError(f"planes must be uint8 [N, 3K/4] for K={K}, got {planes.dtype} {list(planes.shape)}")
    config = configs.launch_config("bitplane_mma", planes.shape[0], K, x.device, config, block_n=block_n,
                                   split_k=split_k, num_warps=num_warps, num_stages=num_stages)
    return _mma(x, planes, scales, 6, config)


def int8_mma(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, block_n: int | None = None,
             split_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
             silu_columns: int = 0, silu_div: int = 1, config: configs.MmaConfig | None = None) -> torch.Tensor:
    """``x @ W.T`` over compressed-tensors INT8 ``weight_packed`` (``int32 [N, K/4]``) and scales;
    ``silu_columns`` > 0 applies the HC SiLU epilogue (module docstring) to that many outputs."""
    K = x.shape[1]
    if packed.dtype != torch.int32 or packed.shape[1] * 4 != K or not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous int32 [N, K/4] for K={K}, got {packed.dtype} {list(packed.shape)}")
    config = configs.launch_config("int8_mma", packed.shape[0], K, x.device, config, block_n=block_n, split_k=split_k,
                                   num_warps=num_warps, num_stages=num_stages)
    return _mma(x, packed.view(torch.uint8), scales, 8, config, silu_columns, silu_div)


def prefill_through(device) -> str:
    """``"gemm"`` or ``"dequantize"``: how a prefill multiplies on ``device`` (``configs``' ``prefill`` row)."""
    return configs.config_for("prefill", device=device).through


def int8_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for any ``x [M, K]`` over compressed-tensors INT8 words: :func:`int8_mma` for
    decode batches; above 16 tokens :func:`~.prefill_gemm.int8_gemm` where the device's ``prefill``
    row says ``gemm`` and its tiles fill the device (:func:`~.prefill_gemm.fills_device`), else a
    GEMM over the weights dequantized to ``x``'s dtype (each ``q * s`` rounded once) by
    :func:`~.dequantize.int8_dequantize` (on the host off CUDA without the interpreter)."""
    M, K = x.shape
    if M and (x.is_cuda or INTERPRETED):
        if M <= MMA_MAX_TOKENS:
            return int8_mma(x, packed, scales)
        if prefill_through(x.device) == "gemm" and fills_device("int8_gemm", M, packed.shape[0], K, x.device):
            return int8_gemm(x, packed, scales)
        return torch.nn.functional.linear(x, int8_dequantize(packed, scales, x.dtype))
    return torch.nn.functional.linear(x, int8_weights(packed, scales, x.dtype))


def int8_weights(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weights ``q * s`` of compressed-tensors INT8 words (``int32 [rows, K/4]``) in ``dtype``,
    each rounded once: what :func:`int8_mma` multiplies by, for a GEMM or a row gather."""
    return dequantize_groups(unpack_int32(packed, 8, packed.shape[1] * 4), scales, dtype)


def gathered_rows_bytes(rows: int, cols: int, group: int, scale_bytes: int = 2) -> int:
    """The bytes held at once by gathering ``rows`` rows of compressed-tensors INT8 words (``cols``
    wide, one byte a weight) with their group scales and taking :func:`int8_weights` of them: the
    gathered words and scales, the int8 codes, and the fp32 codes, scales and product. Its
    ``dtype`` rows are made once the fp32 codes are freed, inside that peak. (What an INT8
    embedding holds for a step of ``rows`` tokens: ``flashnext plan``'s ledger counts it.)"""
    gathered = rows * (cols + cols // group * scale_bytes)
    codes = rows * cols
    fp32 = rows * (2 * cols + cols // group) * 4
    return gathered + codes + fp32


def matmul_variant(M: int, N: int, K: int, device=None, family: str | None = None) -> str:
    """``"gemv"`` or ``"mma"``: the kernel :func:`bitplane_matmul` runs for ``M`` tokens over an
    ``[N, K]`` weight on ``device`` (or device ``family``), from ``configs``' ``bitplane_matmul`` rows."""
    choice = configs.config_for("bitplane_matmul", N, K, device, family)
    return "gemv" if M <= min(choice.gemv_max_tokens, GEMV_MAX_TOKENS) else "mma"


def fused_gemvs_win(M: int, gate_up: tuple[int, int], down: tuple[int, int], device=None,
                    family: str | None = None) -> bool:
    """Whether a bit-plane MLP step of ``M`` tokens (``gate_up`` and ``down`` as ``(N, K)``) runs as
    the two fused GEMVs of :mod:`.bitplane_gemv` (gate_up + SiLU, down + gated combine) rather than
    :func:`bitplane_matmul` and the elementwise steps: up to the ``bitplane_mlp`` row's token count
    for the device, and only where the launch table picks the GEMV for both matrices. On the H200
    the fused GEMVs lost the whole step at 1, 2 and 4 tokens (docs/benchmarks.md, issue 28)."""
    if M > min(configs.config_for("bitplane_mlp", device=device, family=family).fused_max_tokens, GEMV_MAX_TOKENS):
        return False
    return all(matmul_variant(M, n, k, device, family) == "gemv" for n, k in (gate_up, down))


def bitplane_matmul(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for any number of tokens over bit-plane weights: for 1..16 the decode kernel that
    measured faster (:func:`matmul_variant`), above that the device's ``prefill`` row: the tiled
    prefill GEMM, or the weight dequantized by :func:`~.dequantize.bitplane_dequantize` and a
    cuBLAS GEMM."""
    M, K = x.shape
    if M > MMA_MAX_TOKENS:
        if prefill_through(x.device) == "dequantize":
            return torch.nn.functional.linear(x, bitplane_dequantize(planes, scales, x.dtype))
        return bitplane_gemm(x, planes, scales)
    if matmul_variant(M, planes.shape[0], K, x.device) == "gemv":
        return bitplane_gemv(x, planes, scales)
    return bitplane_mma(x, planes, scales)


def warm_bitplane_matmul(planes: torch.Tensor, scales: torch.Tensor) -> None:
    """Launch, once and on zeros, the kernel variants :func:`bitplane_matmul` takes for 5..16 tokens
    (the tensor-core kernel) and for prefill (the tiled GEMM) over this weight; neither variant
    depends on the token count.

    CUDA graphs are captured for 1, 2 and 4 tokens (the profiles' ``cudagraph_capture_sizes``);
    a layer that takes the GEMV there (a small one, or a shared expert that decode-05 runs through
    the fused GEMVs) would otherwise compile and load the tensor-core kernel at its first eager step
    of 5..16 tokens, in the middle of serving and outside vLLM's memory budget (seed 000 §5). Called
    when the weights are loaded, before vLLM measures free memory."""
    K = planes.shape[1] * 4 // 3
    for tokens in (MMA_MAX_TOKENS, MMA_MAX_TOKENS + 1):
        bitplane_matmul(torch.zeros(tokens, K, dtype=scales.dtype, device=planes.device), planes, scales)
