"""Symmetric group-wise round-to-nearest with MSE-searched scales.

For each group of ``group_size`` consecutive input values the scale is chosen to minimise the
squared reconstruction error ``sum((q*s - x)**2)``, evaluated with ``s`` already rounded to the
dtype it is stored in (bf16 for a bf16 checkpoint), because that rounded scale is what the serving
kernel multiplies by.

The search, per group:

1. A grid of clip positions: the group's largest-magnitude value ``m`` is mapped to ``t`` (so
   ``s = m / t``) for every ``t`` of :attr:`MseSearch.grid`, on both sides of zero. Mapping ``m`` to
   ``-2**(b-1)`` uses the one extra code on the negative side; that needs a negative scale when
   ``m > 0``. compressed-tensors and vLLM only compute ``q*s``, and AutoRound releases already
   carry negative scales. ``positive_scales`` restricts the grid to ``s > 0``.
2. Alternating refinement from the best grid point: the codes are refit to the scale (round to
   nearest, clamp), then the scale is re-solved by least squares for those codes
   (``s = sum(x*q) / sum(q*q)``) and rounded to the storage dtype. A step is kept only if it lowers
   the error, so the result is never worse than the grid.

An all-zero group gets scale 0 and codes 0, which dequantize exactly.

With calibration (``importance``: per input column, e.g. ``diag(X^T X)`` of the activations the
matrix multiplies), the error of every step is weighted, ``sum(d * (q*s - x)**2)``, and the least
squares refit is the weighted one (``s = sum(d*x*q) / sum(d*q*q)``): the scale is chosen for the
output the matrix produces on those activations, not for the weight alone. A uniform ``importance``
gives exactly the unweighted result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashnext.errors import FlashnextError
from flashnext.quant.quantizers.base import (
    SUPPORTED_GROUP_SIZES, GroupQuantized, Quantizer, check_group_size, dequantize, register_quantizer,
)

# GroupQuantized, dequantize and check_group_size are the interface's (base.py); they stay
# importable from here, where callers have always found them (benchmarks/calibrated_quality.py).
__all__ = ["SUPPORTED_GROUP_SIZES", "AbsmaxRtn", "GroupQuantized", "MseRtn", "MseSearch", "calibrated_grid",
           "check_group_size", "default_chunk_groups", "dequantize", "quantize_absmax_rtn", "quantize_mse_rtn"]


def _default_grid() -> tuple[float, ...]:
    # |t| from 6.0 to 10.0 in steps of 0.25: 7.5 is plain absmax RTN (compressed-tensors'
    # observer), 8 puts the extreme exactly on -8, larger values clip the tail.
    return tuple(6.0 + 0.25 * i for i in range(17))


def calibrated_grid() -> tuple[float, ...]:
    """The grid of a calibrated search: |t| from 5.0 to 11.0. With activation weights, clipping a
    group harder (or less) than weight-only MSE would is worth it more often; on MiniLM's held-out
    activations this grid took the per-layer output error from 0.007218 to 0.007169
    (docs/benchmarks.md). The weight-only default keeps :func:`_default_grid`."""
    return tuple(5.0 + 0.25 * i for i in range(25))


def _default_fine() -> tuple[float, ...]:
    # Relative steps around the refined scale, finer than the grid's ~3% spacing.
    return tuple(sign * 0.005 * k for k in range(1, 7) for sign in (1, -1))


@dataclass(frozen=True)
class MseSearch:
    """Parameters of the scale search (the defaults are what ``make-mtp-int4`` uses).

    ``grid`` holds the positions ``t`` that the group's largest magnitude is mapped to
    (``s = absmax / t``), ``fine`` the relative perturbations tried around the refined scale, and
    ``refits`` the number of code-refit / least-squares rounds after each of the two stages.
    """

    grid: tuple[float, ...] = field(default_factory=_default_grid)
    fine: tuple[float, ...] = field(default_factory=_default_fine)
    refits: int = 2
    positive_scales: bool = False


def _signed_max(x: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude in each row, with its sign."""
    return x.gather(1, x.abs().argmax(dim=1, keepdim=True)).squeeze(1)


class _GroupSolver:
    """Evaluates candidate scales on a chunk of groups ``x [G, group_size]`` (float32)."""

    def __init__(self, x: torch.Tensor, bits: int, scale_dtype: torch.dtype, weights: torch.Tensor | None = None):
        self.x = x
        self.weights = weights  # per element, >= 0; None: all ones
        self.lo = float(-(1 << (bits - 1)))
        self.hi = float((1 << (bits - 1)) - 1)
        self.scale_dtype = scale_dtype
        self.q = torch.empty_like(x)
        self.r = torch.empty_like(x)

    def stored(self, scale: torch.Tensor) -> torch.Tensor:
        """Round to the storage dtype; a zero scale (all-zero or underflowing group) becomes 1
        so that no NaN appears, and its codes come out 0 anyway only for all-zero groups."""
        s = scale.to(self.scale_dtype).to(torch.float32)
        return torch.where(s == 0, torch.ones_like(s), s)

    def codes(self, s: torch.Tensor) -> torch.Tensor:
        torch.div(self.x, s.unsqueeze(1), out=self.q)
        return self.q.round_().clamp_(self.lo, self.hi)

    def error(self, s: torch.Tensor) -> torch.Tensor:
        """Squared error of the group at stored scale ``s`` (codes left in ``self.q``)."""
        q = self.codes(s)
        torch.mul(q, s.unsqueeze(1), out=self.r)
        self.r.sub_(self.x)
        return self.dot(self.r, self.r)

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Per group ``sum(d * a * b)`` (``sum(a * b)`` without weights)."""
        if self.weights is None:
            return torch.linalg.vecdot(a, b)
        return torch.linalg.vecdot(a * self.weights, b)


class _Best:
    """Per-group best scale and error so far."""

    def __init__(self, solver: "_GroupSolver", like: torch.Tensor):
        self.solver = solver
        self.err = torch.full_like(like, float("inf"))
        self.s = torch.ones_like(like)

    def offer(self, s: torch.Tensor) -> None:
        err = self.solver.error(s)
        better = err < self.err
        self.err = torch.where(better, err, self.err)
        self.s = torch.where(better, s, self.s)

    def refit(self, rounds: int, positive_only: bool) -> None:
        x = self.solver.x
        for _ in range(rounds):
            q = self.solver.codes(self.s)
            qq = self.solver.dot(q, q)
            xq = self.solver.dot(x, q)
            s_ls = torch.where(qq > 0, xq / torch.where(qq > 0, qq, torch.ones_like(qq)), self.s)
            if positive_only:
                s_ls = torch.where(s_ls > 0, s_ls, self.s)
            self.offer(self.solver.stored(s_ls))


def _solve_chunk(x: torch.Tensor, bits: int, scale_dtype: torch.dtype, search: MseSearch,
                 weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    solver = _GroupSolver(x, bits, scale_dtype, weights)
    amax = x.abs().amax(dim=1)
    best = _Best(solver, amax)
    # A positive t maps the group's largest magnitude to +t (scale > 0); a negative t maps it to
    # the other side (scale < 0), where the code -2**(b-1) is.
    positions = list(search.grid)
    if not search.positive_scales:
        positions += [-t for t in search.grid]
    for t in positions:
        best.offer(solver.stored(amax / t))
    best.refit(search.refits, search.positive_scales)
    anchor = best.s
    for delta in search.fine:
        best.offer(solver.stored(anchor * (1.0 + delta)))
    best.refit(search.refits, search.positive_scales)
    codes = solver.codes(best.s).to(torch.int8)
    scale = torch.where(amax == 0, torch.zeros_like(best.s), best.s)
    return codes, scale.to(scale_dtype)


def _quantize_groups(weight: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype,
                     solve, chunk_groups: int, importance: torch.Tensor | None = None) -> GroupQuantized:
    if weight.dim() != 2:
        raise FlashnextError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    check_group_size(cols, group_size)
    groups = weight.reshape(-1, group_size)
    weights = None if importance is None else _group_weights(importance, rows, cols, group_size)
    codes = torch.empty(groups.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(groups.shape[0], dtype=scale_dtype, device=weight.device)
    for start in range(0, groups.shape[0], chunk_groups):
        stop = min(start + chunk_groups, groups.shape[0])
        x = groups[start:stop].to(torch.float32)
        if weights is None:
            codes[start:stop], scale[start:stop] = solve(x)
        else:
            codes[start:stop], scale[start:stop] = solve(x, weights[start:stop].to(torch.float32))
    return GroupQuantized(codes.view(rows, cols), scale.view(rows, cols // group_size), group_size)


def _group_weights(importance: torch.Tensor, rows: int, cols: int, group_size: int) -> torch.Tensor:
    """``importance`` ([cols], or [rows, cols] for a stack of matrices each with its own) as one
    row of weights per group, in the groups' order."""
    if importance.shape not in ((cols,), (rows, cols)):
        raise FlashnextError(f"importance of shape {tuple(importance.shape)} does not fit a [{rows}, {cols}] weight")
    if not torch.isfinite(importance).all() or bool((importance < 0).any()):
        raise FlashnextError("importance must be finite and non-negative")
    return importance.to(torch.float32).expand(rows, cols).reshape(-1, group_size)


def default_chunk_groups(device: torch.device) -> int:
    # On the CPU a chunk that fits in L2 keeps the candidate loop out of DRAM; on a GPU the
    # chunk should be large enough to fill the device.
    return 1 << 11 if device.type == "cpu" else 1 << 20


def quantize_mse_rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128,
                     scale_dtype: torch.dtype = torch.bfloat16,
                     search: MseSearch | None = None,
                     chunk_groups: int | None = None,
                     importance: torch.Tensor | None = None) -> GroupQuantized:
    """Quantize ``weight [N, K]`` symmetrically per group with MSE-searched scales; with
    ``importance`` ([K] or [N, K], e.g. ``diag(X^T X)`` of calibration activations), the searched
    error is weighted by it.

    >>> w = torch.randn(4, 256)
    >>> qw = quantize_mse_rtn(w, bits=4, group_size=128)
    >>> qw.codes.shape, qw.scale.shape
    (torch.Size([4, 256]), torch.Size([4, 2]))
    """
    search = search or MseSearch()
    chunk = chunk_groups or default_chunk_groups(weight.device)
    return _quantize_groups(weight, bits, group_size, scale_dtype,
                            lambda x, d=None: _solve_chunk(x, bits, scale_dtype, search, d), chunk, importance)


def quantize_absmax_rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128,
                        scale_dtype: torch.dtype = torch.bfloat16,
                        chunk_groups: int | None = None) -> GroupQuantized:
    """Plain RTN as compressed-tensors' min-max observer does it: ``s = absmax / ((qmax-qmin)/2)``."""
    half_range = ((1 << bits) - 1) / 2

    def solve(x: torch.Tensor):
        solver = _GroupSolver(x, bits, scale_dtype)
        amax = x.abs().amax(dim=1)
        s = solver.stored(amax / half_range)
        codes = solver.codes(s).to(torch.int8)
        return codes, torch.where(amax == 0, torch.zeros_like(s), s).to(scale_dtype)

    chunk = chunk_groups or default_chunk_groups(weight.device)
    return _quantize_groups(weight, bits, group_size, scale_dtype, solve, chunk)


@register_quantizer("mse")
class MseRtn(Quantizer):
    """The default of ``make-mtp-int4``: :func:`quantize_mse_rtn`; calibrated, on the wider
    :func:`calibrated_grid` and weighted by ``importance``."""

    description = "MSE-searched scales, round-to-nearest"

    def __init__(self, positive_scales: bool = False, calibrated: bool = False, search: MseSearch | None = None):
        super().__init__(positive_scales, calibrated)
        grid = calibrated_grid() if calibrated else _default_grid()
        self.search = search or MseSearch(grid=grid, positive_scales=positive_scales)

    def quantize(self, weight: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype,
                 importance: torch.Tensor | None = None, gram: torch.Tensor | None = None) -> GroupQuantized:
        return quantize_mse_rtn(weight, bits, group_size, scale_dtype, self.search, importance=importance)

    def options(self) -> dict:
        return {"grid": list(self.search.grid), "fine": list(self.search.fine), "refits": self.search.refits,
                "positive_scales": self.search.positive_scales}


@register_quantizer("rtn")
class AbsmaxRtn(Quantizer):
    """compressed-tensors' min-max observer: :func:`quantize_absmax_rtn`, the A side of A/B runs
    (absmax scales are positive anyway, and it ignores activations)."""

    description = "absmax scales, round-to-nearest"

    def quantize(self, weight: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype,
                 importance: torch.Tensor | None = None, gram: torch.Tensor | None = None) -> GroupQuantized:
        return quantize_absmax_rtn(weight, bits, group_size, scale_dtype)
