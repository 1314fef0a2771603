"""Tiled GEMM for prefill batches (more than 16 tokens) over the weights the decode kernels read:
INT6 bit planes (:func:`bitplane_gemm`) and compressed-tensors INT8 words (:func:`int8_gemm`).

Before this kernel the int6-bitplane and int8-modules layers handled a prefill batch by
dequantizing the whole weight to bf16 and calling a bf16 GEMM, on every call: 4-14x slower than
stock vLLM's Humming at 512 tokens on the H200 (docs/benchmarks.md, issue 28), and a transient
bf16 copy of the weight outside vLLM's memory budget. Here each program owns a ``BLOCK_M x
BLOCK_N`` output tile (tokens x weight rows), walks K in steps, rebuilds the step's weights in
registers exactly as :mod:`.decode_mma` does (the same helpers, so the numerics are the decode
kernel's: INT6 multiplies ``bf16(q * s)``, INT8 the exact codes scaled once per group) and
accumulates ``tl.dot`` products in fp32. No split-K: where the tiles do not fill the device (a few
hundred rows over a long K), :func:`fills_device` says so, and ``int8_matmul`` takes
dequantize-then-GEMM there instead.

The token blocks of one weight block are consecutive program ids, so they run together and read the
weight block from L2 rather than from memory once each. The tile is the seed's W8A16 prefill GEMM's
(32 tokens x 64 rows; seed 000 measured 102 us against Marlin's 120 at 512 tokens on a 3090, and
64x64 4% slower); per-device rows are in :mod:`.configs` (``"bitplane_gemm"``, ``"int8_gemm"``).

``M`` is not specialized, so one compiled variant serves every prefill length of a layer: the
variant is compiled by vLLM's profiling run or the load-time warm-up, before vLLM measures free
memory, never mid-service.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext.quant.kernels import configs
from flashnext.quant.kernels import _common
from flashnext.quant.kernels._common import INTERPRETED, step_product


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                 GROUP: tl.constexpr, STEP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_FP32: tl.constexpr, BITS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    tokens = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = tokens < M
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    columns = tl.arange(0, STEP)
    x_rows = x_ptr + tokens[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for step in range(0, K // STEP):
        x = tl.load(x_rows + step * STEP + columns[None, :], mask=m_mask[:, None], other=0.0)
        acc += step_product(x, w_ptr, s_ptr, rows, n_mask, stride_wn, stride_sn, step, K, GROUP, STEP, BLOCK_N,
                            DOT_FP32, BITS)
    out = y_ptr + tokens[:, None].to(tl.int64) * stride_ym + rows[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])


def _gemm(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, bits: int,
          config: configs.GemmConfig) -> torch.Tensor:
    M, K = x.shape
    N = weights.shape[0]
    group = K // scales.shape[1]
    if scales.shape[0] != N or group * scales.shape[1] != K or group % 16:
        raise ValueError(f"scales {list(scales.shape)} do not fit [{N}, {K}] in groups of a multiple of 16")
    step = config.step(K, group) if bits == 6 else group
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    grid = (triton.cdiv(M, config.block_m), triton.cdiv(N, config.block_n))
    _gemm_kernel[grid](x, weights, scales, y, M, N, K, x.stride(0), weights.stride(0), scales.stride(0), y.stride(0),
                       GROUP=group, STEP=step, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                       DOT_FP32=INTERPRETED, BITS=bits, num_warps=config.num_warps, num_stages=config.num_stages)
    return y


def fills_device(kernel: str, M: int, N: int, K: int, device) -> bool:
    """Whether ``kernel``'s launch for ``M`` tokens over an ``[N, K]`` weight has at least one output
    tile per SM. Below that, with no split-K, a long K runs on a few SMs: INT8's HC down/inject
    (336 x 10240) at 512 tokens took 73 us here against 44 for dequantize-then-GEMM (H200,
    docs/benchmarks.md), while every shape whose tiles filled the device was faster here."""
    config = configs.config_for(kernel, N, K, device)
    return triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n) >= _common.sm_count(device)


def bitplane_gemm(x: torch.Tensor, planes: torch.Tensor, scales: torch.Tensor, block_m: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  config: configs.GemmConfig | None = None) -> torch.Tensor:
    """``x @ W.T`` for any number of tokens over INT6 bit-plane weights ``uint8 [N, 3K/4]`` and
    scales ``[N, K / group]``; the launch is ``configs``' ``bitplane_gemm`` row unless given.

    >>> y = bitplane_gemm(x, layer.weight_packed, layer.weight_scale)  # x: bf16 [512, K] on CUDA
    """
    K = x.shape[1]
    if planes.dtype != torch.uint8 or planes.shape[1] * 4 != K * 3:
        raise ValueError(f"planes must be uint8 [N, 3K/4] for K={K}, got {planes.dtype} {list(planes.shape)}")
    config = configs.launch_config("bitplane_gemm", planes.shape[0], K, x.device, config, block_m=block_m,
                                   block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    return _gemm(x, planes, scales, 6, config)


def int8_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, block_m: int | None = None,
              block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
              config: configs.GemmConfig | None = None) -> torch.Tensor:
    """``x @ W.T`` for any number of tokens over compressed-tensors INT8 ``weight_packed``
    (``int32 [N, K/4]``) and scales ``[N, K / group]``.

    >>> y = int8_gemm(x, layer.weight_packed, layer.weight_scale)
    """
    K = x.shape[1]
    if packed.dtype != torch.int32 or packed.shape[1] * 4 != K or not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous int32 [N, K/4] for K={K}, got {packed.dtype} {list(packed.shape)}")
    config = configs.launch_config("int8_gemm", packed.shape[0], K, x.device, config, block_m=block_m,
                                   block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    return _gemm(x, packed.view(torch.uint8), scales, 8, config)
