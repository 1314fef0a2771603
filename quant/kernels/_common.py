"""What every kernel here shares: whether Triton interprets, the bf16 dot that survives it, the SM
count, the split-K counters, INT8 code and INT6 bit-plane weight loads, and "can this kernel take
this batch".

One home for these because each kernel module used to carry its own copy (two ``INTERPRETED``,
two counter caches) or reached into another module's private helpers; a fix to one (the
interpreter's bf16 dot, a counter buffer's lifetime) now reaches them all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashnext import envs

# Triton 3.8's interpreter multiplies bf16 dot operands as their raw 16-bit integers; interpreted
# runs widen them to fp32 first, which is exact (the product of two bf16 is exact in fp32).
INTERPRETED = envs.TRITON_INTERPRET.get() == "1"


@triton.jit
def dot(a, b, DOT_FP32: tl.constexpr):
    """``a @ b.T`` in bf16, accumulated in fp32; in fp32 under the interpreter, whose bf16 dot is wrong."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
    return tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)))


@triton.jit
def int8_codes(w_ptr, rows, n_mask, stride_wn, g, GROUP: tl.constexpr):
    """Group ``g``'s INT8 codes for ``rows`` from compressed-tensors' packed words viewed as bytes
    (``q + 128`` in k order), as int32."""
    columns = tl.arange(0, GROUP)
    row_base = w_ptr + rows[:, None].to(tl.int64) * stride_wn
    return tl.load(row_base + g * GROUP + columns[None, :], mask=n_mask[:, None], other=128).to(tl.int32) - 128


@triton.jit
def bitplane_weights(w_ptr, s_ptr, rows, n_mask, stride_wn, stride_sn, step, K, GROUP: tl.constexpr,
                      STEP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Step ``step``'s dequantized weights ``q * s`` for ``rows``, fp32 ``[BLOCK_N, STEP]`` in k order
    (:func:`dot` rounds them to bf16 on the GPU).

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
def step_product(x, w_ptr, s_ptr, rows, n_mask, stride_wn, stride_sn, step, K, GROUP: tl.constexpr,
                 STEP: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, BITS: tl.constexpr):
    """``x [tokens, STEP] @ W[rows, step's columns].T`` in fp32, for INT8 words (``STEP == GROUP``:
    exact integer products, scaled once per group) or INT6 bit planes (the weights ``bf16(q * s)``)."""
    if BITS == 8:
        codes = int8_codes(w_ptr, rows, n_mask, stride_wn, step, GROUP)
        scale = tl.load(s_ptr + rows * stride_sn + step, mask=n_mask, other=0).to(tl.float32)
        return dot(x, codes, DOT_FP32) * scale[None, :]
    weights = bitplane_weights(w_ptr, s_ptr, rows, n_mask, stride_wn, stride_sn, step, K, GROUP, STEP, BLOCK_N)
    return dot(x, weights, DOT_FP32)


def sm_count(device) -> int:
    """The device's streaming multiprocessors; 4 off CUDA, so interpreted runs split K a little."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def can_launch(x: torch.Tensor, max_tokens: int) -> bool:
    """Whether a decode kernel taking 1..``max_tokens`` rows can run on ``x`` here: Triton needs a
    CUDA tensor, or the interpreter."""
    return 1 <= x.shape[0] <= max_tokens and (x.is_cuda or INTERPRETED)


# (device, kernel) -> zeroed int32 counters. Per kernel, as before there was one cache: two kernels
# launched on different streams must not count in the same words.
_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}
# Buffers a grown cache replaced. A CUDA graph captured the old buffer's address and replays into
# it, so it must stay allocated for the process's life (a few KiB).
_RETIRED: list[torch.Tensor] = []
SPLITK_COUNTERS = 1024  # the fewest int32 counters a kernel's first launch on a device allocates


def splitk_counters(device, n: int, kernel: str) -> torch.Tensor:
    """At least ``n`` zeroed split-K counters for ``kernel`` on ``device``; the kernel leaves every
    counter it used at zero again, so launches on one stream share them."""
    have = _COUNTERS.get((device, kernel))
    if have is None or have.numel() < n:
        if have is not None:
            _RETIRED.append(have)
        have = _COUNTERS[(device, kernel)] = torch.zeros(max(n, SPLITK_COUNTERS), dtype=torch.int32, device=device)
    return have
