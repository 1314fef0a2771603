"""``--calib`` for the draft experts: the routed statistics of each MTP layer, and a batch of
experts' share of them in the shapes the quantizer's ``quantize(importance=, gram=)`` and the error
report take.

The statistics themselves (routing, top-up, held-out tokens) are
:mod:`flashnext.quant.quantizers.calibration`'s; this module only connects them to the snapshot
(the layer's router, its config) and to a batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, Snapshot
from flashnext.quant.overlays.mtp_int4.source import DraftLayerExperts, load_router
from flashnext.quant.records.jsonfile import get_int

if TYPE_CHECKING:
    import torch

    from flashnext.quant.quantizers.calibration import RoutedStatistics


def routed_statistics(snap: Snapshot, layers: list[DraftLayerExperts], path: Path, min_tokens: int,
                      prior_tokens: int) -> dict[str, RoutedStatistics]:
    """``{layer prefix: RoutedStatistics}``: the tokens of ``path`` routed by each layer's router as
    the model routes them (``num_experts_per_tok``, ``norm_topk_prob``)."""
    from flashnext.quant.quantizers.calibration import RoutedStatistics, load_calibration

    tc, where = snap.text_config, f"{snap.root / CONFIG_FILE}: text config"
    top_k = get_int(tc, "num_experts_per_tok", where, minimum=1)
    experts = layers[0].num_experts
    if top_k > experts:
        raise FlashnextError(f"routes each token as the model does, to num_experts_per_tok distinct experts: "
                             f"{where}: num_experts_per_tok {top_k} is more than num_experts {experts}", field="calib")
    calib = load_calibration(path, get_int(tc, "hidden_size", where, minimum=1))
    renormalize = bool(tc.get("norm_topk_prob", True))
    return {layer.prefix: RoutedStatistics(calib, load_router(snap, layer), top_k, renormalize, min_tokens,
                                           prior_tokens)
            for layer in layers}


class RoutedBatch:
    """A batch of experts' calibration inputs, laid out for the quantizer and the error report."""

    def __init__(self, routed: RoutedStatistics, batch: dict[str, torch.Tensor], start: int, device: torch.device):
        self.experts = [routed.expert(start + i, batch["gate"][i].cpu(), batch["up"][i].cpu())
                        for i in range(batch["gate"].shape[0])]
        self.device = device
        self._grams: dict[str, torch.Tensor] = {}

    def importance(self, proj: str, rows: int) -> torch.Tensor:
        """``[b * rows, cols]``: each expert's column importance, repeated over its rows."""
        import torch

        d = torch.stack([e.d_mid if proj == "down" else e.d_in for e in self.experts]).to(self.device)
        b, cols = d.shape
        return d.unsqueeze(1).expand(b, rows, cols).reshape(b * rows, cols)

    def gram(self, proj: str) -> torch.Tensor:
        """``[b, cols, cols]``: each expert's Gram matrix. Gate and up multiply one input and get
        the very same tensor, which lets a quantizer factor it once for both."""
        import torch

        key = "mid" if proj == "down" else "in"
        if key not in self._grams:  # only the latest is kept: gate, up, then down
            self._grams = {key: torch.stack([e.gram(proj) for e in self.experts]).to(self.device)}
        return self._grams[key]

    def output_energy(self, proj: str, delta: torch.Tensor) -> float:
        """``sum_e ||X_e ΔW_eᵀ||²`` for ``delta [b, rows, cols]``, ``X_e`` the held-out calibration
        tokens routed to expert ``e`` (routing-weighted): the output error, whatever the rounding."""
        return sum(float((e.held_out(proj).to(self.device) @ d.T).square().sum()) for e, d in zip(self.experts, delta))
