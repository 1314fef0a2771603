"""The overlay report's error figures, accumulated batch by batch.

Each projection's relative weight MSE is set beside plain absmax RTN's (compressed-tensors' own
observer, :data:`REFERENCE`) on the same weights, so that a report says what the scale search
bought; with ``--calib`` the output error on held-out calibration tokens is measured for this
overlay, plain RTN and the weight-only default alike. The reference passes cost one more
quantization per matrix (two with ``--calib``), which is why they can be switched off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashnext.quant.overlays.mtp_int4.source import BITS, PROJECTIONS

if TYPE_CHECKING:
    import torch

    from flashnext.quant.overlays.mtp_int4.calibrated import RoutedBatch
    from flashnext.quant.quantizers.base import GroupQuantized, Quantizer

REFERENCE = "rtn"        # what "vs absmax RTN" compares with
WEIGHT_ONLY = "mse"      # with --calib: the default without it, for the output-error comparison


@dataclass
class ProjectionErrors:
    matrices: int = 0
    groups: int = 0
    sq_err: float = 0.0
    sq_err_absmax: float = 0.0
    sq_weight: float = 0.0
    max_abs_err: float = 0.0
    negative_scales: int = 0
    zero_groups: int = 0
    # With --calib: the output error on the held-out calibration tokens, ||X ΔWᵀ||² routing-weighted,
    # for this overlay, plain RTN and the weight-only default.
    out_err: float = 0.0
    out_err_absmax: float = 0.0
    out_err_weight_only: float = 0.0
    out_weight: float = 0.0

    def to_json(self, shape: tuple[int, int]) -> dict:
        rel = self.sq_err / self.sq_weight if self.sq_weight else 0.0
        rel_absmax = self.sq_err_absmax / self.sq_weight if self.sq_weight else 0.0
        out = {"matrices": self.matrices, "shape": list(shape), "groups": self.groups,
               "rel_mse": rel, "absmax_rtn_rel_mse": rel_absmax,
               "ratio_to_absmax_rtn": rel / rel_absmax if rel_absmax else None,
               "max_abs_err": self.max_abs_err, "negative_scales": self.negative_scales,
               "zero_groups": self.zero_groups}
        if self.out_weight:
            out |= {"output_rel_mse": self.out_err / self.out_weight,
                    "absmax_rtn_output_rel_mse": self.out_err_absmax / self.out_weight,
                    "weight_only_output_rel_mse": self.out_err_weight_only / self.out_weight}
        return out


class ErrorReport:
    """Per projection :class:`ProjectionErrors`, fed one batch of experts at a time."""

    def __init__(self, quantizer_name: str, positive_scales: bool, compare: bool, group_size: int):
        from flashnext.quant.quantizers.base import get_quantizer

        self.group_size = group_size
        self.projections = {p: ProjectionErrors() for p in PROJECTIONS}
        # Plain RTN is its own reference: its error is counted once, as both.
        self.is_reference = quantizer_name == REFERENCE
        self.reference: Quantizer | None = get_quantizer(REFERENCE) if compare and not self.is_reference else None
        self.weight_only: Quantizer = get_quantizer(WEIGHT_ONLY, positive_scales=positive_scales)

    def add_batch(self, weights: dict[str, torch.Tensor], results: dict[str, GroupQuantized],
                  scale_dtype: torch.dtype, calib: RoutedBatch | None) -> None:
        """Count one batch: ``weights[proj]`` ``[b, rows, cols]`` float32 as read, ``results[proj]``
        what the overlay stores for it (``[b * rows, cols]``)."""
        for proj, w in weights.items():
            self._add(proj, w, results[proj], scale_dtype, calib)

    def _add(self, proj: str, w: torch.Tensor, q: GroupQuantized, scale_dtype: torch.dtype,
             calib: RoutedBatch | None) -> None:
        import torch

        from flashnext.quant.quantizers.base import dequantize

        gs = self.group_size
        b, rows, cols = w.shape
        flat = w.reshape(b * rows, cols)
        st = self.projections[proj]
        err = dequantize(q.codes, q.scale, gs).float() - flat
        st.sq_err += float(torch.linalg.vecdot(err.view(-1), err.view(-1)))
        st.sq_weight += float(torch.linalg.vecdot(flat.view(-1), flat.view(-1)))
        st.max_abs_err = max(st.max_abs_err, float(err.abs().max()))
        st.negative_scales += int((q.scale < 0).sum())
        st.zero_groups += int((q.scale == 0).sum())
        st.groups += q.scale.numel()
        st.matrices += b
        if self.is_reference:
            st.sq_err_absmax = st.sq_err
        elif self.reference is not None:
            ref = self.reference.quantize(flat, BITS, gs, scale_dtype)
            ref_err = dequantize(ref.codes, ref.scale, gs).float() - flat
            st.sq_err_absmax += float(torch.linalg.vecdot(ref_err.view(-1), ref_err.view(-1)))
            if calib is not None:
                plain = self.weight_only.quantize(flat, BITS, gs, scale_dtype)
                plain_err = dequantize(plain.codes, plain.scale, gs).float() - flat
                st.out_weight += calib.output_energy(proj, flat.view(b, rows, cols))
                for attr, e in (("out_err", err), ("out_err_absmax", ref_err), ("out_err_weight_only", plain_err)):
                    setattr(st, attr, getattr(st, attr) + calib.output_energy(proj, e.view(b, rows, cols)))

    def to_json(self, shapes: dict[str, tuple[int, int]]) -> dict:
        return {p: self.projections[p].to_json(shapes[p]) for p in PROJECTIONS}
