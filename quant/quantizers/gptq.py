"""GPTQ-style rounding: choose each code knowing the error already made on earlier columns.

Round-to-nearest quantizes every weight on its own. GPTQ (Frantar et al., 2022) goes column by
column and pushes each column's rounding error onto the columns not yet quantized, through the
inverse of the calibration Gram matrix ``H = XᵀX``, so that the *output* ``XWᵀ`` stays close rather
than each weight. Here the scales are fixed first (the activation-weighted search of
:mod:`~flashnext.quant.quantizers.mse_rtn`, "static groups"), so the result is the same format
(codes and one scale per group) and only the codes change. Registered as the quantizer ``"gptq"``
(:class:`Gptq`), which needs the Gram matrices of calibration inputs (``make-mtp-int4 --calib``).

Batched: ``b`` matrices with their own ``H`` go through the column loop together, which is what
makes 512 experts cheap on a GPU (one loop of K steps per batch, not per expert).
"""

from __future__ import annotations

import torch

from flashnext.errors import FlashnextError
from flashnext.quant.quantizers.base import GroupQuantized, register_quantizer
from flashnext.quant.quantizers.mse_rtn import MseRtn

DAMPING = 0.01  # of the mean diagonal, added to H (GPTQ's usual 1%)
BLOCK = 128     # columns updated lazily together (GPTQ's block size)


def inverse_cholesky(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of ``H⁻¹`` ([b, K, K]), after damping and with dead columns fixed:
    what :func:`gptq_codes` needs of a Gram matrix (compute it once for matrices that share one,
    such as an expert's gate and up projections)."""
    h = h.clone()
    k = h.shape[-1]
    diag = h.diagonal(dim1=-2, dim2=-1)
    dead = diag <= 0
    diag.masked_fill_(dead, 1.0)
    mean = diag.mean(-1, keepdim=True)
    diag.add_(DAMPING * mean)
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    for attempt in range(4):  # an ill-conditioned H gets more damping rather than a NaN
        factor, info = torch.linalg.cholesky_ex(h)
        if not bool(info.any()):
            break
        h = h + (DAMPING * 10 ** (attempt + 1)) * mean.unsqueeze(-1) * eye
    inverse = torch.cholesky_inverse(factor)
    return torch.linalg.cholesky(inverse, upper=True)


def gptq_codes(weight: torch.Tensor, gram: torch.Tensor | None, scale: torch.Tensor, group_size: int,
               bits: int = 4, factor: torch.Tensor | None = None) -> torch.Tensor:
    """Codes for ``weight [b, N, K]`` (float32) at the fixed ``scale [b, N, K // group_size]``
    (as stored, e.g. bf16), chosen by GPTQ with ``gram [b, K, K]`` (``XᵀX`` of each matrix's
    calibration inputs), or its ``factor`` from :func:`inverse_cholesky`. Returns int8 codes
    ``[b, N, K]``."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    b, n, k = weight.shape
    u = factor if factor is not None else inverse_cholesky(gram.to(torch.float32))  # [b, K, K], upper
    w = weight.to(torch.float32).clone()
    s = scale.to(torch.float32)
    s = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero group: codes 0 whatever the scale
    codes = torch.empty((b, n, k), dtype=torch.int8, device=weight.device)
    for start in range(0, k, BLOCK):
        stop = min(start + BLOCK, k)
        block = w[:, :, start:stop]
        errors = torch.empty_like(block)
        u_block = u[:, start:stop, start:stop]
        for i in range(stop - start):
            col = start + i
            s_col = s[:, :, col // group_size]
            q = (block[:, :, i] / s_col).round_().clamp_(lo, hi)
            codes[:, :, col] = q.to(torch.int8)
            err = (block[:, :, i] - q * s_col) / u_block[:, i, i].unsqueeze(1)
            # The rest of the block absorbs this column's error (rank-1 update).
            block[:, :, i:] -= err.unsqueeze(2) * u_block[:, i, i:].unsqueeze(1)
            errors[:, :, i] = err
        if stop < k:
            w[:, :, stop:] -= torch.bmm(errors, u[:, start:stop, stop:])
    return codes


@register_quantizer("gptq")
class Gptq(MseRtn):
    """:class:`~flashnext.quant.quantizers.mse_rtn.MseRtn`'s scales (activation-weighted when
    calibrated), then codes chosen by :func:`gptq_codes` against each matrix's ``gram``."""

    description = "MSE-searched scales, GPTQ rounding"
    uses_gram = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (gram, its factor)

    def quantize(self, weight: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype,
                 importance: torch.Tensor | None = None, gram: torch.Tensor | None = None) -> GroupQuantized:
        if gram is None:
            raise FlashnextError("is needed: GPTQ rounding chooses codes against calibration activations "
                                 "(their Gram matrix XᵀX)", field="calib")
        rows, cols = weight.shape
        stack = gram.shape[0] if gram.dim() == 3 else 1
        if gram.dim() not in (2, 3) or tuple(gram.shape[-2:]) != (cols, cols) or rows % stack:
            raise FlashnextError(f"gram of shape {tuple(gram.shape)} does not fit a [{rows}, {cols}] weight")
        searched = super().quantize(weight, bits, group_size, scale_dtype, importance)
        per = rows // stack
        codes = gptq_codes(weight.reshape(stack, per, cols), None, searched.scale.view(stack, per, -1),
                           group_size, bits, factor=self._factor(gram))
        return GroupQuantized(codes.view(rows, cols), searched.scale, group_size)

    def _factor(self, gram: torch.Tensor) -> torch.Tensor:
        # Matrices that multiply one input (an expert's gate and up) are handed the same Gram
        # tensor: the factor of the last one is kept, and computed once for both.
        if self._last is None or self._last[0] is not gram:
            self._last = None  # let the previous pair go before the new factor is made
            stacked = gram if gram.dim() == 3 else gram.unsqueeze(0)
            self._last = (gram, inverse_cholesky(stacked.to(torch.float32)))
        return self._last[1]
