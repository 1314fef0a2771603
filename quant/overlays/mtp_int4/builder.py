"""The MTP INT4 overlay builder: options, the per-batch quantize, the report.

The builder streams each draft layer's experts ``experts_per_batch`` at a time
(:func:`~flashnext.quant.overlays.mtp_int4.source.load_batch`), hands every projection of a batch
to the registered quantizer the options name, with the batch's calibration statistics when there
are some, writes the packed result, and gives the batch to the error report once. Which quantizer
runs is the registry's business (``quant/quantizers/base.py``): nothing here knows one from another
beyond what a quantizer declares (``uses_gram``).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flashnext.errors import UsageError
from flashnext.progress import Progress
from flashnext.quant.checkpoint.fsutil import sha256_file
from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, Snapshot
from flashnext.quant.formats.ct_config import set_quantization_config, with_mtp_experts_quantized
from flashnext.quant.formats.safetensors_io import DTYPE_BYTES, ShardWriter, TensorSpec, torch_dtypes
from flashnext.quant.overlays.builder import OverlayBuilder, OverlayKind
from flashnext.quant.overlays.mtp_int4.card import card_section
from flashnext.quant.overlays.mtp_int4.metrics import ErrorReport
from flashnext.quant.overlays.mtp_int4.source import (
    BITS, PROJECTIONS, DraftLayerExperts, expert_specs, expert_tensor_names, find_draft_experts, load_batch,
    scale_dtype_for, updated_weight_map,
)
from flashnext.quant.quantizers.base import available_quantizers, check_group_size, require_finite
from flashnext.quant.records.jsonfile import get_int

# torch and the quantizers (which import it) are imported where tensors are touched: options and
# outputs are checked, and a bad one refused, in well under the seconds torch takes to import.
if TYPE_CHECKING:
    import torch

DEFAULT_QUANTIZER = "mse"
PLAIN_RTN = "rtn"  # absmax scales, no search: the A side of the A/B measurement
GPTQ = "gptq"  # the searched scales, codes chosen against each expert's routed Gram matrix


def needs_calibration(quantizer: str) -> UsageError:
    return UsageError(f"is needed by quantizer {quantizer}, which chooses codes against calibration activations",
                      field="calib")


@dataclass(frozen=True)
class MtpInt4Options:
    group_size: int = 128
    positive_scales: bool = False
    device: str = "cpu"
    experts_per_batch: int | None = None
    # A registered quantizer (quant.quantizers.base.available_quantizers()): "mse" searches the
    # scales, "rtn" is plain absmax RTN (compressed-tensors' observer), "gptq" (needs calib) chooses
    # codes against each expert's routed Gram matrix at the searched scales (quant.quantizers.gptq).
    quantizer: str = DEFAULT_QUANTIZER
    compare_absmax: bool = True  # the report's ratio to plain RTN; costs one extra pass
    # Activations at the MTP MoE block's input (quant.quantizers.calibration): the scale search
    # then weights each column by its routed tokens' diag(X^T X).
    calib: Path | None = None
    calib_min_tokens: int = 32
    gptq_prior_tokens: int = 640

    def __post_init__(self) -> None:
        if self.quantizer not in available_quantizers():
            raise UsageError(f"{self.quantizer!r}: no such quantizer; available: {', '.join(available_quantizers())}",
                             field="quantizer")
        if self.quantizer == GPTQ and self.calib is None:
            raise needs_calibration(self.quantizer)
        if self.calib is not None and not self.scale_search:
            raise UsageError(f"weights the scale search, which quantizer {PLAIN_RTN} does not make", field="calib")

    @property
    def scale_search(self) -> bool:
        """Whether the scales are searched (every quantizer but plain RTN), for the report."""
        return self.quantizer != PLAIN_RTN

    @property
    def rounding(self) -> str:
        """How codes are chosen, for the report: "gptq" or "nearest"."""
        return "gptq" if self.quantizer == GPTQ else "nearest"


class MtpInt4Builder(OverlayBuilder):
    """The MTP draft head's routed experts as INT4 pack-quantized tensors."""

    kinds = (OverlayKind("mtp-int4", card_tags=("int4", "w4a16", "compressed-tensors", "mtp", "speculative-decoding"),
                         draft_method="mtp"),)
    tool = "make-mtp-int4"
    headroom = 16 << 20

    def __init__(self, snap: Snapshot, options: MtpInt4Options = MtpInt4Options()):
        from flashnext.quant.overlays.mtp_int4.calibrated import routed_statistics
        from flashnext.quant.quantizers.base import get_quantizer
        from flashnext.quant.quantizers.device import usable_device

        super().__init__(snap)
        self.started = time.perf_counter()
        self.options = options
        self.layers = find_draft_experts(snap)
        gs = options.group_size
        for layer in self.layers:
            for proj in PROJECTIONS:
                check_group_size(layer.shape(proj)[1], gs, f"{layer.prefix} {proj}_proj")
        self.device = usable_device(options.device)
        self.per_batch = options.experts_per_batch or (4 if self.device.type == "cpu" else 32)
        # Check the rewritten config both as the checkpoint names the draft layers and as vLLM does.
        offset = get_int(snap.text_config, "num_hidden_layers", f"{snap.root / CONFIG_FILE}: text config", minimum=0)
        draft_indices = sorted({idx for layer in self.layers for idx in (layer.layer, offset + layer.layer)})
        self.new_qc = with_mtp_experts_quantized(snap.quantization_config, BITS, gs, draft_indices)
        calibrated = options.calib is not None
        self.quantizer = get_quantizer(options.quantizer, positive_scales=options.positive_scales,
                                       calibrated=calibrated)
        if self.quantizer.uses_gram and not calibrated:
            raise needs_calibration(options.quantizer)
        self.errors = ErrorReport(options.quantizer, options.positive_scales, options.compare_absmax, gs)
        self.bytes_read = 0
        self.routed = {}
        self.calib_sha256 = None
        if calibrated:
            prior = options.gptq_prior_tokens if self.quantizer.uses_gram else 0
            self.routed = routed_statistics(snap, self.layers, Path(options.calib), options.calib_min_tokens, prior)
            self.calib_sha256 = sha256_file(options.calib)

    def inputs(self) -> dict[str, Path]:
        return {"the calibration file": Path(self.options.calib)} if self.options.calib is not None else {}

    def plan(self) -> dict[str, list[TensorSpec]]:
        """The replaced shards: their other tensors in file order, then the new expert tensors."""
        replaced_names = {n for layer in self.layers for n in layer.sources}
        plans: dict[str, list[TensorSpec]] = {}
        for layer in self.layers:
            for proj in PROJECTIONS:
                plans.setdefault(layer.source_shard(proj), [])
        for filename in plans:
            plans[filename] = [s for s in self.snap.header(filename).specs_in_file_order()
                               if s.name not in replaced_names]
        for layer in self.layers:
            for proj in PROJECTIONS:
                plans[layer.source_shard(proj)] += expert_specs(layer, self.options.group_size, proj)
        return plans

    def fill(self, writers: dict[str, ShardWriter], progress: bool) -> None:
        total_weights = sum(layer.num_experts * 3 * layer.intermediate * layer.hidden for layer in self.layers)
        bar = Progress(total_weights, progress, self.tool, unit="w")
        try:
            for layer in self.layers:
                for start in range(0, layer.num_experts, self.per_batch):
                    stop = min(start + self.per_batch, layer.num_experts)
                    self._quantize_batch(layer, start, stop, writers, bar)
        finally:
            bar.close()

    def _quantize_batch(self, layer: DraftLayerExperts, start: int, stop: int, writers: dict[str, ShardWriter],
                        bar: Progress) -> None:
        """Quantize and write experts ``[start, stop)`` of ``layer``, then count their errors."""
        from flashnext.quant.overlays.mtp_int4.calibrated import RoutedBatch

        scale_dtype = torch_dtypes()[scale_dtype_for(layer.dtype)]
        batch = load_batch(self.snap, layer, start, stop, self.device)
        for proj in PROJECTIONS:
            require_finite(batch[proj], f"{layer.prefix} {proj}_proj of experts {start}..{stop - 1}", (start,))
        routed = self.routed.get(layer.prefix)
        calib = None if routed is None else RoutedBatch(routed, batch, start, self.device)
        results = {}
        for proj in PROJECTIONS:
            w = batch[proj]
            b, rows, cols = w.shape
            statistics = {}
            if calib is not None:
                statistics["importance"] = calib.importance(proj, rows)
                if self.quantizer.uses_gram:
                    statistics["gram"] = calib.gram(proj)
            q = self.quantizer.quantize(w.reshape(b * rows, cols), BITS, self.options.group_size, scale_dtype,
                                        **statistics)
            self._write(writers[layer.source_shard(proj)], layer, proj, start, q.codes.view(b, rows, cols),
                        q.scale.view(b, rows, -1))
            results[proj] = q
            self.bytes_read += w.numel() * DTYPE_BYTES[layer.dtype]
            bar.update(w.numel())
        self.errors.add_batch(batch, results, scale_dtype, calib)

    @staticmethod
    def _write(writer: ShardWriter, layer: DraftLayerExperts, proj: str, start: int, codes: torch.Tensor,
               scales: torch.Tensor) -> None:
        import torch

        from flashnext.quant.formats.packing import pack_int32

        b, rows, cols = codes.shape
        packed = pack_int32(codes.reshape(b * rows, cols), BITS).view(b, rows, -1).cpu()
        scales = scales.cpu()
        for i in range(b):
            packed_name, scale_name, shape_name = expert_tensor_names(layer.prefix, start + i, proj)
            writer.write(packed_name, packed[i])
            writer.write(scale_name, scales[i].contiguous())
            writer.write(shape_name, torch.tensor([rows, cols], dtype=torch.int64))

    def new_weight_map(self, plans: dict[str, list[TensorSpec]]) -> dict[str, str]:
        return updated_weight_map(self.snap.weight_map, self.layers)

    def new_config(self) -> dict:
        config = copy.deepcopy(self.snap.config)
        set_quantization_config(config, self.new_qc)  # where quantization_holder finds the base's
        return config

    def report(self) -> dict:
        elapsed = time.perf_counter() - self.started
        first = self.layers[0]
        return {
            "tool": self.tool,
            "bits": BITS, "group_size": self.options.group_size, "symmetric": True,
            "positive_scales": self.options.positive_scales,
            "scale_search": self.options.scale_search,
            "scale_dtype": scale_dtype_for(first.dtype),
            "search": self.quantizer.options() or None,
            "quantizer": self.quantizer.name,
            "quantizer_description": self.quantizer.description,
            "mode": ("calibrated, GPTQ rounding" if self.options.rounding == "gptq" else "calibrated")
                    if self.routed else "weight-only",
            "rounding": self.options.rounding,
            "gptq_prior_tokens": self.options.gptq_prior_tokens if self.quantizer.uses_gram else None,
            "calibration": self._calibration_report(),
            "device": str(self.device),
            "draft_layers": [layer.prefix for layer in self.layers],
            "source_layout": first.layout,
            "experts": first.num_experts,
            "projections": self.errors.to_json({p: first.shape(p) for p in PROJECTIONS}),
            "bytes_read": self.bytes_read,
            "seconds": round(elapsed, 3),
            "read_gb_per_s": round(self.bytes_read / elapsed / 1e9, 3) if elapsed else None,
        }

    def _calibration_report(self) -> dict | None:
        if not self.routed:
            return None
        return {"file": self.options.calib.name, "sha256": self.calib_sha256,
                "layers": {prefix: r.summary() for prefix, r in self.routed.items()}}

    @classmethod
    def card_section(cls, report: dict) -> list[str]:
        return card_section(report)


def make_mtp_int4(src: Path, out: Path, options: MtpInt4Options = MtpInt4Options(),
                  force: bool = False, progress: bool = True) -> dict:
    """Build the overlay at ``out`` from the snapshot ``src`` (never modified). Returns the report."""
    return MtpInt4Builder(Snapshot.open(src), options).build(out, force=force, progress=progress)
