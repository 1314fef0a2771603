"""Build the MTP INT4 overlay: the draft head's routed experts as INT4 pack-quantized tensors.

Only the MTP routed experts change. Every base shard that holds them is rewritten under the same
file name: its other tensors are copied byte for byte, and the BF16 experts (fused
``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``, or per-expert
``experts.{e}.{gate,up,down}_proj.weight``) are replaced by per-expert compressed-tensors tensors
``experts.{e}.{gate,up,down}_proj.{weight_packed,weight_scale,weight_shape}``, the names vLLM's
FusedMoE loader maps to ``w13_*`` / ``w2_*``. The overlay also carries the updated index and
config.json (see :func:`quant.formats.ct_config.with_mtp_experts_quantized`) and ``overlay.json``.

Memory: experts are streamed ``experts_per_batch`` at a time. Each expert in flight costs about
23 bytes per weight (bf16 source, fp32 working copy, int8 codes, int64 packing temporaries), i.e.
about 0.11 GiB for the real head's expert (H 2560, I 640, 4.9 M weights); the solver's scratch is
chunked (a few MiB on the CPU). The source is read with ``pread`` rather than mmap, so nothing of it
stays resident: with the default 4 experts per batch the whole process peaked at 1.12 GiB on the
real-size head (docs/benchmarks.md), whatever the number of experts.
"""

from __future__ import annotations

import copy
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from flashnext.errors import FlashnextError, UsageError
from flashnext.progress import Progress
from flashnext.quant.checkpoint.fsutil import make_parents, refuse_overlap, sha256_file, write_text_atomic
from flashnext.quant.records.jsonfile import get_int, read_json
from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, INDEX_FILE, Snapshot
from flashnext.quant.formats.ct_config import with_mtp_experts_quantized
from flashnext.quant.formats.safetensors_io import DTYPE_BYTES, ShardWriter, TensorSpec, read_rows
from flashnext.quant.overlays.builder import OverlayBuilder, register_builder

# torch and the quantizers (which import it) are imported where tensors are touched: options and
# outputs are checked, and a bad one refused, in well under the seconds torch takes to import.
if TYPE_CHECKING:
    import torch

    from flashnext.quant.quantizers.base import Quantizer
    from flashnext.quant.quantizers.calibration import RoutedStatistics

BITS = 4
PROJECTIONS = ("gate", "up", "down")
FLOAT_DTYPES = ("BF16", "F16", "F32")  # the expert dtypes it quantizes

_FUSED = re.compile(r"^(?P<prefix>(?:.*\.)?mtp\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?mtp\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<suffix>\w+)$")


@dataclass
class DraftLayerExperts:
    """The routed experts of one MTP layer in the source snapshot."""

    prefix: str  # e.g. "mtp.layers.0.mlp.experts"
    layer: int
    layout: str  # "fused" or "per_expert"
    num_experts: int
    hidden: int
    intermediate: int
    dtype: str
    sources: dict[str, str] = field(default_factory=dict)  # source tensor name -> shard file

    def source_shard(self, proj: str) -> str:
        if self.layout == "fused":
            key = f"{self.prefix}.{'down_proj' if proj == 'down' else 'gate_up_proj'}"
        else:
            key = f"{self.prefix}.0.{proj}_proj.weight"
        return self.sources[key]

    def shape(self, proj: str) -> tuple[int, int]:
        return (self.hidden, self.intermediate) if proj == "down" else (self.intermediate, self.hidden)


def find_draft_experts(snap: Snapshot) -> list[DraftLayerExperts]:
    """Locate and validate the MTP routed experts against config.json."""
    tc = snap.text_config
    where = f"{snap.root / CONFIG_FILE}: text config"
    E, H, I = (get_int(tc, key, where, minimum=1)
               for key in ("num_experts", "hidden_size", "moe_intermediate_size"))
    fused: dict[str, dict[str, str]] = {}
    per_expert: dict[str, dict[str, str]] = {}
    for name in snap.weight_map:
        if m := _FUSED.match(name):
            fused.setdefault(m["prefix"], {})[name] = snap.weight_map[name]
        elif m := _PER_EXPERT.match(name):
            if m["suffix"] != "weight":
                raise FlashnextError(
                    f"{snap.root}: the MTP experts are already quantized ({name}); "
                    "make-mtp-int4 needs a snapshot with BF16 MTP experts")
            per_expert.setdefault(m["prefix"], {})[name] = snap.weight_map[name]
    if not fused and not per_expert:
        raise FlashnextError(
            f"{snap.root}: no MTP routed experts in {INDEX_FILE} (looked for "
            "mtp.layers.N.mlp.experts.gate_up_proj or mtp.layers.N.mlp.experts.E.gate_proj.weight); "
            "this snapshot has no draft head")
    layers = []
    for prefix, names in sorted(fused.items()):
        layer = DraftLayerExperts(prefix, int(_FUSED.match(next(iter(names)))["layer"]), "fused",
                                  E, H, I, "", names)
        for proj, shape in (("gate_up_proj", (E, 2 * I, H)), ("down_proj", (E, H, I))):
            name = f"{prefix}.{proj}"
            if name not in names:
                raise FlashnextError(f"{snap.root}: {name} is missing from {INDEX_FILE}")
            layer.dtype = _check_tensor(snap, name, shape, layer.dtype)
        layers.append(layer)
    for prefix, names in sorted(per_expert.items()):
        if prefix in fused:
            raise FlashnextError(f"{snap.root}: {prefix} is stored both fused and per expert")
        layer = DraftLayerExperts(prefix, int(_PER_EXPERT.match(next(iter(names)))["layer"]),
                                  "per_expert", E, H, I, "", names)
        for e in range(E):
            for proj in PROJECTIONS:
                name = f"{prefix}.{e}.{proj}_proj.weight"
                if name not in names:
                    raise FlashnextError(f"{snap.root}: {name} is missing from {INDEX_FILE}")
                layer.dtype = _check_tensor(snap, name, layer.shape(proj), layer.dtype)
        extra = [n for n in names if int(_PER_EXPERT.match(n)["expert"]) >= E]
        if extra:
            raise FlashnextError(f"{snap.root}: {extra[0]} is beyond num_experts={E} of config.json")
        layers.append(layer)
    return layers


def _check_tensor(snap: Snapshot, name: str, shape: tuple[int, ...], dtype: str) -> str:
    _, entry = snap.entry(name)
    if entry.dtype not in FLOAT_DTYPES:
        raise FlashnextError(f"{name} is {entry.dtype}: the MTP experts are already quantized or "
                             "not floating point; make-mtp-int4 needs BF16/F16/F32 experts")
    if entry.shape != shape:
        raise FlashnextError(f"{name} has shape {list(entry.shape)} but config.json implies "
                             f"{list(shape)} (num_experts, hidden_size, moe_intermediate_size)")
    if dtype and entry.dtype != dtype:
        raise FlashnextError(f"{name} is {entry.dtype} while other MTP experts are {dtype}")
    return entry.dtype


def expert_tensor_names(prefix: str, expert: int, proj: str) -> tuple[str, str, str]:
    base = f"{prefix}.{expert}.{proj}_proj"
    return f"{base}.weight_packed", f"{base}.weight_scale", f"{base}.weight_shape"


def _expert_specs(layer: DraftLayerExperts, group_size: int, proj: str) -> list[TensorSpec]:
    from flashnext.quant.formats.packing import packed_words

    scale_dtype = layer.dtype if layer.dtype != "F32" else "BF16"
    rows, cols = layer.shape(proj)
    specs = []
    for e in range(layer.num_experts):
        packed, scale, shape = expert_tensor_names(layer.prefix, e, proj)
        specs += [TensorSpec(packed, "I32", (rows, packed_words(cols, BITS))),
                  TensorSpec(scale, scale_dtype, (rows, cols // group_size)),
                  TensorSpec(shape, "I64", (2,))]
    return specs


@dataclass
class _ProjectionStats:
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

    def add_output(self, proj: str, calib: "_BatchCalibration", shape: tuple[int, int, int], flat: torch.Tensor,
                   errors: dict[str, torch.Tensor]) -> None:
        self.out_weight += calib.output_energy(proj, flat.view(shape))
        for attr, err in errors.items():
            setattr(self, attr, getattr(self, attr) + calib.output_energy(proj, err.view(shape)))


@dataclass(frozen=True)
class MtpInt4Options:
    group_size: int = 128
    positive_scales: bool = False
    device: str = "cpu"
    experts_per_batch: int | None = None
    # False: plain absmax RTN (compressed-tensors' observer) instead of the MSE scale search, the
    # A side of the A/B measurement.
    scale_search: bool = True
    compare_absmax: bool = True  # the report's ratio to plain RTN; costs one extra pass
    # Activations at the MTP MoE block's input (quant.quantizers.calibration): the scale search
    # then weights each column by its routed tokens' diag(X^T X).
    calib: Path | None = None
    calib_min_tokens: int = 32
    # "nearest", or "gptq" (needs calib): codes chosen against each expert's routed Gram matrix
    # at the searched scales (quant.quantizers.gptq).
    rounding: str = "nearest"
    gptq_prior_tokens: int = 640

    def __post_init__(self) -> None:
        if self.rounding not in ("nearest", "gptq"):
            raise UsageError(f"rounding {self.rounding!r}: use nearest or gptq")
        if self.rounding == "gptq" and self.calib is None:
            raise UsageError("--rounding gptq chooses codes against calibration activations: give --calib FILE")
        if self.calib is not None and not self.scale_search:
            raise UsageError("--calib weights the scale search: it cannot go with --no-scale-search")


def _check_finite(t: torch.Tensor, what: str) -> None:
    import torch

    if not torch.isfinite(t).all():
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        raise FlashnextError(f"{what} contains NaN or Inf (first at index {bad}); refusing to quantize")


@register_builder
class MtpInt4Builder(OverlayBuilder):
    """The MTP draft head's routed experts as INT4 pack-quantized tensors."""

    kinds = ("mtp-int4",)
    tool = "make-mtp-int4"
    headroom = 16 << 20

    def __init__(self, snap: Snapshot, options: MtpInt4Options = MtpInt4Options()):
        from flashnext.quant.quantizers.base import get_quantizer
        from flashnext.quant.quantizers.mse_rtn import MseSearch, calibrated_grid, check_group_size

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
        self.search = MseSearch(positive_scales=options.positive_scales)
        if options.calib is not None:
            self.search = MseSearch(grid=calibrated_grid(), positive_scales=options.positive_scales)
        self.quantizer = get_quantizer("mse", search=self.search) if options.scale_search else get_quantizer("rtn")
        # The report's ratio to plain RTN costs one more pass; plain RTN is its own reference.
        self.reference = get_quantizer("rtn") if options.scale_search and options.compare_absmax else None
        self.stats = {p: _ProjectionStats() for p in PROJECTIONS}
        self.bytes_read = 0
        self.routed: dict[str, RoutedStatistics] = {}
        self.calib_sha256 = None
        self.weight_only: Quantizer | None = None  # with --calib: today's default, for the report's comparison
        if options.calib is not None:
            self._load_calibration(options.calib)

    def _load_calibration(self, path: Path) -> None:
        import torch

        from flashnext.quant.quantizers.base import get_quantizer
        from flashnext.quant.quantizers.calibration import RoutedStatistics, load_calibration
        from flashnext.quant.quantizers.mse_rtn import MseSearch

        tc, where = self.snap.text_config, f"{self.snap.root / CONFIG_FILE}: text config"
        top_k = get_int(tc, "num_experts_per_tok", where, minimum=1)
        experts = self.layers[0].num_experts
        if top_k > experts:
            raise FlashnextError(f"{where}: num_experts_per_tok {top_k} is more than num_experts {experts}; "
                                 "--calib routes each token as the model does, to that many distinct experts")
        calib = load_calibration(path, get_int(tc, "hidden_size", where, minimum=1))
        renormalize = bool(tc.get("norm_topk_prob", True))
        for layer in self.layers:
            router_name = f"{layer.prefix.removesuffix('.experts')}.gate.weight"
            if router_name not in self.snap.weight_map:
                raise FlashnextError(f"--calib needs the MTP router {router_name}, which the snapshot does not have")
            file, entry = self.snap.entry(router_name)
            router = read_rows(file, entry, 0, entry.shape[0]).to(torch.float32)
            if tuple(router.shape) != (layer.num_experts, layer.hidden):
                raise FlashnextError(f"{router_name} has shape {tuple(router.shape)}; expected "
                                     f"[{layer.num_experts}, {layer.hidden}]")
            prior = self.options.gptq_prior_tokens if self.options.rounding == "gptq" else 0
            self.routed[layer.prefix] = RoutedStatistics(calib, router, top_k, renormalize,
                                                         self.options.calib_min_tokens, prior)
        self.calib_sha256 = sha256_file(path)
        self.weight_only = get_quantizer("mse", search=MseSearch(positive_scales=self.options.positive_scales))

    def inputs(self) -> dict[str, Path]:
        return {"--calib": Path(self.options.calib)} if self.options.calib is not None else {}

    @property
    def kind(self) -> str:
        return "mtp-int4"

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
                plans[layer.source_shard(proj)] += _expert_specs(layer, self.options.group_size, proj)
        return plans

    def fill(self, writers: dict[str, ShardWriter], progress: bool) -> None:
        total_weights = sum(layer.num_experts * 3 * layer.intermediate * layer.hidden for layer in self.layers)
        bar = Progress(total_weights, progress, self.tool, unit="w")
        try:
            for layer in self.layers:
                self.bytes_read += _quantize_layer(self.snap, layer, writers, self.stats, self.quantizer,
                                                   self.reference, self.options, self.device, self.per_batch, bar,
                                                   self.routed.get(layer.prefix),
                                                   self.weight_only)
        finally:
            bar.close()

    def new_weight_map(self, plans: dict[str, list[TensorSpec]]) -> dict[str, str]:
        return _updated_weight_map(self.snap.weight_map, self.layers, plans)

    def new_config(self) -> dict:
        config = copy.deepcopy(self.snap.config)
        holder = config if "quantization_config" in config else config.get("text_config", config)
        holder["quantization_config"] = self.new_qc
        return config

    def report(self) -> dict:
        elapsed = time.perf_counter() - self.started
        first = self.layers[0]
        return {
            "tool": self.tool,
            "bits": BITS, "group_size": self.options.group_size, "symmetric": True,
            "positive_scales": self.options.positive_scales,
            "scale_search": self.options.scale_search,
            "scale_dtype": "BF16" if first.dtype == "F32" else first.dtype,
            "search": {"grid": list(self.search.grid), "fine": list(self.search.fine), "refits": self.search.refits},
            "quantizer": self.quantizer.name,
            "quantizer_description": self.quantizer.description,
            "mode": ("calibrated, GPTQ rounding" if self.options.rounding == "gptq" else "calibrated")
                    if self.routed else "weight-only",
            "rounding": self.options.rounding,
            "gptq_prior_tokens": self.options.gptq_prior_tokens if self.options.rounding == "gptq" else None,
            "calibration": self._calibration_report(),
            "device": str(self.device),
            "draft_layers": [layer.prefix for layer in self.layers],
            "source_layout": first.layout,
            "experts": first.num_experts,
            "projections": {p: self.stats[p].to_json(first.shape(p)) for p in PROJECTIONS},
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
        if not report.get("projections"):
            return []
        lines = ["## Quantization report", "",
                 f"INT{report.get('bits')} symmetric, group size {report.get('group_size')}, "
                 f"scales in {report.get('scale_dtype')}, "
                 + report.get("quantizer_description", "MSE-searched scales, round-to-nearest")
                 + (" (positive scales only)" if report.get("positive_scales") else " (signed scales)") + ".", ""]
        calib = report.get("calibration")
        calibrated = str(report.get("mode", "")).startswith("calibrated")
        if calibrated and calib:
            tokens = next(iter(calib["layers"].values()))["tokens"]
            gptq = (" Codes are then chosen by GPTQ against each expert's routed Gram matrix XᵀX."
                    if report.get("rounding") == "gptq" else "")
            lines += [f"Mode: **{report['mode']}** on {tokens:,} tokens ({calib['file']}, sha256 "
                      f"{calib['sha256'][:12]}): each expert's scales minimise the output error on the tokens "
                      f"its router sends it (diag(XᵀX)-weighted scale search).{gptq}", ""]
        else:
            lines += ["Mode: **weight-only** (no calibration data): scales minimise the weight error.", ""]
        lines += ["| projection | matrices | relative MSE | vs absmax RTN | negative scales | all-zero groups |",
                  "|---|---|---|---|---|---|"]
        for proj, s in report["projections"].items():
            ratio = f"{s['ratio_to_absmax_rtn']:.3f}x" if s.get("ratio_to_absmax_rtn") else "—"
            lines.append(f"| {proj} | {s['matrices']} | {s['rel_mse']:.4e} | {ratio} | "
                         f"{s['negative_scales']} | {s['zero_groups']} |")
        if calibrated:
            lines += ["", "Output error on held-out calibration tokens (relative, routing-weighted ||XΔWᵀ||²):", "",
                      "| projection | this overlay | weight-only default | absmax RTN |", "|---|---|---|---|"]
            for proj, s in report["projections"].items():
                if "output_rel_mse" in s:
                    lines.append(f"| {proj} | {s['output_rel_mse']:.4e} | {s['weight_only_output_rel_mse']:.4e} | "
                                 f"{s['absmax_rtn_output_rel_mse']:.4e} |")
        return lines


def make_mtp_int4(src: Path, out: Path, options: MtpInt4Options = MtpInt4Options(),
                  force: bool = False, progress: bool = True) -> dict:
    """Build the overlay at ``out`` from the snapshot ``src`` (never modified). Returns the report."""
    return MtpInt4Builder(Snapshot.open(src), options).build(out, force=force, progress=progress)


def check_report_path(report: Path, src: Path, out: Path) -> None:
    """``--report`` may not write into the source or the overlay, nor replace a file that is not an
    earlier report (checked before the work starts, so a bad path costs nothing)."""
    refuse_overlap(report, {"the source snapshot": src, "--out": out})
    if report.is_dir():
        raise FlashnextError(f"--report {report} is a directory; name a file")
    if report.exists() or report.is_symlink():
        try:
            earlier = read_json(report, "a make-mtp-int4 report")
        except FlashnextError:
            earlier = {}
        if earlier.get("tool") != "make-mtp-int4":
            raise FlashnextError(f"--report {report} exists and is not a make-mtp-int4 report; "
                                 "choose another file")


def write_report(report: Path, result: dict, inputs: dict[str, Path | None] | None = None) -> None:
    """Write ``--report``; it may not be, contain or lie inside ``inputs`` as opened when written."""
    make_parents(report)
    write_text_atomic(report, json.dumps(result, indent=2) + "\n", inputs=inputs)


def usable_device(name: str) -> torch.device:
    """The device to quantize on: the CPU or a CUDA device this process can use."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise FlashnextError(f"--device {name!r} is not a device name: {str(e).splitlines()[0]}") from None
    if device.type not in ("cpu", "cuda"):
        raise FlashnextError(f"--device {name!r}: make-mtp-int4 runs on cpu or cuda[:N]")
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:
        raise FlashnextError(f"--device {name!r} is not usable here: {str(e).splitlines()[0]}") from None
    return device


def _load_batch(snap: Snapshot, layer: DraftLayerExperts, start: int, stop: int,
                device: torch.device) -> dict[str, torch.Tensor]:
    """``{proj: [b, rows, cols] float32}`` for experts ``[start, stop)``."""
    import torch

    if layer.layout == "fused":
        gate_up = read_rows(*snap.entry(f"{layer.prefix}.gate_up_proj"), start, stop)
        down = read_rows(*snap.entry(f"{layer.prefix}.down_proj"), start, stop)
        gate_up = gate_up.to(device=device, dtype=torch.float32)
        I = layer.intermediate
        # vLLM 0.33.0 splits the fused tensor with chunk(2, dim=1): rows [0, I) are gate (w1),
        # rows [I, 2I) are up (w3).
        return {"gate": gate_up[:, :I], "up": gate_up[:, I:],
                "down": down.to(device=device, dtype=torch.float32)}
    out = {}
    for proj in PROJECTIONS:
        mats = []
        for e in range(start, stop):
            path, entry = snap.entry(f"{layer.prefix}.{e}.{proj}_proj.weight")
            mats.append(read_rows(path, entry, 0, entry.shape[0]))
        out[proj] = torch.stack(mats).to(device=device, dtype=torch.float32)
    return out


class _BatchCalibration:
    """A batch of experts' calibration inputs, laid out for the quantizer, GPTQ and the report."""

    def __init__(self, routed: RoutedStatistics, batch: dict[str, torch.Tensor], start: int, device: torch.device):
        self.experts = [routed.expert(start + i, batch["gate"][i].cpu(), batch["up"][i].cpu())
                        for i in range(batch["gate"].shape[0])]
        self.device = device
        self._factors: dict[str, torch.Tensor] = {}

    def importance(self, proj: str, rows: int) -> torch.Tensor:
        """``[b * rows, cols]``: each expert's column importance, repeated over its rows."""
        import torch

        d = torch.stack([e.d_mid if proj == "down" else e.d_in for e in self.experts]).to(self.device)
        b, cols = d.shape
        return d.unsqueeze(1).expand(b, rows, cols).reshape(b * rows, cols)

    def factor(self, proj: str) -> torch.Tensor:
        """GPTQ's factor of the batch's Gram matrices; gate and up share theirs (one input)."""
        import torch

        from flashnext.quant.quantizers.gptq import inverse_cholesky

        key = "mid" if proj == "down" else "in"
        if key not in self._factors:
            self._factors[key] = inverse_cholesky(torch.stack([e.gram(proj) for e in self.experts]).to(self.device))
        return self._factors[key]

    def output_energy(self, proj: str, delta: torch.Tensor) -> float:
        """``sum_e ||X_e ΔW_eᵀ||²`` for ``delta [b, rows, cols]``, ``X_e`` the held-out calibration
        tokens routed to expert ``e`` (routing-weighted): the output error, whatever the rounding."""
        return sum(float((e.held_out(proj).to(self.device) @ d.T).square().sum()) for e, d in zip(self.experts, delta))


def _quantize_layer(snap: Snapshot, layer: DraftLayerExperts, writers: dict[str, ShardWriter],
                    stats: dict[str, _ProjectionStats], quantizer: Quantizer, reference: Quantizer | None,
                    options: MtpInt4Options, device: torch.device, per_batch: int, bar: Progress,
                    routed: RoutedStatistics | None = None, weight_only: Quantizer | None = None) -> int:
    import torch

    from flashnext.quant.formats.packing import pack_int32
    from flashnext.quant.quantizers.gptq import gptq_codes
    from flashnext.quant.quantizers.mse_rtn import GroupQuantized, dequantize

    scale_dtype = {"BF16": torch.bfloat16, "F16": torch.float16}.get(layer.dtype, torch.bfloat16)
    element = DTYPE_BYTES[layer.dtype]
    gs = options.group_size
    bytes_read = 0
    for start in range(0, layer.num_experts, per_batch):
        stop = min(start + per_batch, layer.num_experts)
        batch = _load_batch(snap, layer, start, stop, device)
        for proj in PROJECTIONS:
            _check_finite(batch[proj], f"{layer.prefix} {proj}_proj of experts {start}..{stop - 1}")
        calib = None if routed is None else _BatchCalibration(routed, batch, start, device)
        for proj in PROJECTIONS:
            w = batch[proj]
            b, rows, cols = w.shape
            flat = w.reshape(b * rows, cols)
            importance = None if calib is None else calib.importance(proj, rows)
            q = quantizer.quantize(flat, BITS, gs, scale_dtype, importance=importance)
            if calib is not None and options.rounding == "gptq":
                codes = gptq_codes(w, None, q.scale.view(b, rows, -1), gs, BITS, factor=calib.factor(proj))
                q = GroupQuantized(codes.view(b * rows, cols), q.scale, gs)
            packed = pack_int32(q.codes, BITS).view(b, rows, -1).cpu()
            scales = q.scale.view(b, rows, -1).cpu()
            st = stats[proj]
            err = dequantize(q.codes, q.scale, gs).float() - flat
            st.sq_err += float(torch.linalg.vecdot(err.view(-1), err.view(-1)))
            st.sq_weight += float(torch.linalg.vecdot(flat.view(-1), flat.view(-1)))
            st.max_abs_err = max(st.max_abs_err, float(err.abs().max()))
            st.negative_scales += int((q.scale < 0).sum())
            st.zero_groups += int((q.scale == 0).sum())
            st.groups += q.scale.numel()
            st.matrices += b
            if quantizer.name == "rtn":
                st.sq_err_absmax = st.sq_err
            elif reference is not None:
                ref = reference.quantize(flat, BITS, gs, scale_dtype)
                ref_err = dequantize(ref.codes, ref.scale, gs).float() - flat
                st.sq_err_absmax += float(torch.linalg.vecdot(ref_err.view(-1), ref_err.view(-1)))
                if calib is not None:
                    plain = weight_only.quantize(flat, BITS, gs, scale_dtype)
                    st.add_output(proj, calib, (b, rows, cols), flat, {
                        "out_err": err, "out_err_absmax": ref_err,
                        "out_err_weight_only": dequantize(plain.codes, plain.scale, gs).float() - flat})
                del ref_err
            del err
            writer = writers[layer.source_shard(proj)]
            for i, e in enumerate(range(start, stop)):
                packed_name, scale_name, shape_name = expert_tensor_names(layer.prefix, e, proj)
                writer.write(packed_name, packed[i])
                writer.write(scale_name, scales[i].contiguous())
                writer.write(shape_name, torch.tensor([rows, cols], dtype=torch.int64))
            bytes_read += w.numel() * element
            bar.update(w.numel())
        del batch
    return bytes_read


def _updated_weight_map(weight_map: dict[str, str], layers: list[DraftLayerExperts],
                        plans: dict[str, list[TensorSpec]]) -> dict[str, str]:
    """The index's weight_map with each layer's BF16 expert entries replaced in place."""
    new_names: dict[str, list[tuple[str, str]]] = {}
    for layer in layers:
        entries = []
        for e in range(layer.num_experts):
            for proj in PROJECTIONS:
                for n in expert_tensor_names(layer.prefix, e, proj):
                    entries.append((n, layer.source_shard(proj)))
        new_names[layer.prefix] = entries
    anchors = {min(layer.sources, key=list(weight_map).index): layer.prefix for layer in layers}
    dropped = {n for layer in layers for n in layer.sources}
    out: dict[str, str] = {}
    for name, filename in weight_map.items():
        if name in anchors:
            out.update(new_names[anchors[name]])
        if name not in dropped:
            out[name] = filename
    return out
