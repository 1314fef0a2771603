"""Embedding rows in NVFP4 and FP8, as vLLM 0.34.0's ``qwen4_exp`` PLE methods store and read them.

``ple_embedding_dtype: "nvfp4"`` (``Qwen4ExpPLENvFp4EmbeddingMethod``): per shard ``weight`` uint8
``[rows, D/2]`` of E2M1 codes, the even element in the low nibble; ``weight_scale`` float8_e4m3fn
``[rows, D/16]``, one scale per block of 16; and one float32 ``weight_scale_2`` for the table. A
value is ``e2m1(code) * float(block_scale) * weight_scale_2``, rounded once to the activation dtype
(the CPU path's ``dequantize_to_dtype``; the GPU kernel computes the same product).

``ple_embedding_dtype: "float8_e4m3fn"`` (``Qwen4ExpPLEFp8EmbeddingMethod``): ``weight``
float8_e4m3fn ``[rows, D]`` and one float32 ``weight_scale``; the method multiplies in the
activation dtype, ``bf16(fp8) * bf16(scale)``, so the scale chosen here is a bf16 value and the
decoder below rounds where vLLM does.

NVFP4's block scales are searched: each block takes, of a few scales at and below its absmax over 6
(each rounded to E4M3 as stored, and the E4M3 value just above), the one with the least squared
error of the block, as make-mtp-int4 searches INT4 group scales. Plain absmax is one of the
candidates, so no block is worse than absmax (ties keep absmax).
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
# Candidate block scales, as shares of absmax / 6 (1.0 first: absmax wins ties). Eight shares from
# 1.0 to 0.72 gave 0.867 of absmax's squared error on a heavy-tailed table, these four 0.871 at
# about 70% of the time.
SCALE_SEARCH = (1.0, 0.92, 0.84, 0.76)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

FORMATS = {"nvfp4": "nvfp4", "fp8": "float8_e4m3fn"}  # --format -> config.json's ple_embedding_dtype


def nvfp4_global_scale(amax: float) -> float:
    """``weight_scale_2`` for a table whose largest magnitude is ``amax``: the largest block scale
    (absmax / 6) then fits E4M3's 448."""
    return amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0


def fp8_scale(amax: float) -> float:
    """The FP8 table's ``weight_scale``: ``amax / 448`` rounded up to a bf16 value (vLLM multiplies
    in bf16), so that no value exceeds E4M3's range."""
    if amax <= 0:
        return 1.0
    target = torch.tensor(amax / E4M3_MAX, dtype=torch.float32)
    scale = target.to(torch.bfloat16)
    if scale.float() < target:
        scale = torch.nextafter(scale.float(), torch.tensor(float("inf"))).to(torch.bfloat16)
        while scale.float() < target:  # nextafter in fp32 may round back down in bf16
            scale = (scale.float() * (1 + 2 ** -8)).to(torch.bfloat16)
    return float(scale.float())


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (sign in bit 3) of each value, saturating at 6."""
    magnitude = torch.bucketize(scaled.abs(), torch.tensor(_MIDPOINTS, dtype=scaled.dtype, device=scaled.device))
    return (magnitude | ((scaled < 0).to(torch.int64) << 3)).to(torch.uint8)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    values = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -values, values)


def _e4m3_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest E4M3 value at or above each (non-negative) ``x``, as float32, capped at 448."""
    down = x.to(torch.float8_e4m3fn)
    bits = down.view(torch.uint8)
    up = torch.where(down.float() < x, bits + 1, bits).clamp(max=0x7E).view(torch.float8_e4m3fn)
    return up.float()


def nvfp4_encode(x: torch.Tensor, global_scale: float, search: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [n, D]`` as NVFP4: ``(weight uint8 [n, D/2], weight_scale float8_e4m3fn [n, D/16])``
    for the table's ``global_scale``. ``search=False`` is plain absmax (each block's scale its
    absmax / 6, rounded to E4M3)."""
    n, d = x.shape
    if d % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 rows need a multiple of {NVFP4_BLOCK} values, got {d}")
    blocks = x.float().reshape(n, d // NVFP4_BLOCK, NVFP4_BLOCK)
    base = blocks.abs().amax(dim=2) / (E2M1_MAX * global_scale)
    shares = SCALE_SEARCH if search else (1.0,)
    candidates = [(base * share).to(torch.float8_e4m3fn).float() for share in shares]
    if search:
        candidates.append(_e4m3_up(base))
    best_err = best_scale = None
    for scale in candidates:
        step = (scale * global_scale).unsqueeze(2)
        codes = _e2m1_codes(torch.where(step > 0, blocks / step.clamp_min(torch.finfo(torch.float32).tiny), 0.0))
        err = ((_e2m1_values(codes) * step - blocks) ** 2).sum(dim=2)
        if best_err is None:
            best_err, best_scale = err, scale
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
    step = (best_scale * global_scale).unsqueeze(2)
    codes = _e2m1_codes(torch.where(step > 0, blocks / step.clamp_min(torch.finfo(torch.float32).tiny), 0.0))
    codes = codes.reshape(n, d)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, best_scale.to(torch.float8_e4m3fn)


def nvfp4_decode(weight: torch.Tensor, weight_scale: torch.Tensor, global_scale: float,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows of an NVFP4 table as vLLM's method returns them: ``e2m1 * (float(scale) * global)``,
    rounded once to ``dtype``."""
    n = weight.shape[0]
    codes = torch.stack([weight & 0xF, weight >> 4], dim=2).reshape(n, -1)
    step = weight_scale.float() * torch.tensor(global_scale, dtype=torch.float32)
    values = _e2m1_values(codes).reshape(n, -1, NVFP4_BLOCK) * step.unsqueeze(2)
    return values.reshape(n, -1).to(dtype)


def fp8_encode(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows ``x [n, D]`` as FP8 (float8_e4m3fn ``[n, D]``) at the table's ``scale``."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_decode(weight: torch.Tensor, scale: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows of an FP8 table as vLLM's method returns them: ``weight.to(dtype) * scale.to(dtype)``."""
    return weight.to(dtype) * torch.tensor(scale, dtype=torch.float32).to(dtype)
