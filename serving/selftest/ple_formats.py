"""The selftest's "PLE formats" check: the demo checkpoint's PLE table built as NVFP4 and FP8 overlays
(``flashnext ple build --format``), each read back through vLLM 0.34.0's own ``Qwen4ExpNGramEmbedding``.

In the selftest's process (:func:`build_views`, :func:`judge`): the overlays and their views are
built in the work directory; vLLM's rows are then held to flashnext's decoder (bit for bit) and to
the BF16 rows (the relative squared error a user's server gets from the format, on the demo's table).

In the fresh vLLM interpreter that the kernel fit runs in (:func:`read_back`, called by
``kernel_fit``'s ``main``): for each view, vLLM's PLE module built from the view's config.json loads
the view's tensors through its own ``load_weights`` and returns every row of the table through its
own method. The backend is vLLM's device-resident one: the pinned-host one (the served default)
needs a CUDA driver to pin memory and make the UVA view, and reads the same tensors through a Triton
gather of the same formula.
"""

from __future__ import annotations

import json
from pathlib import Path

FORMATS = ("nvfp4", "fp8")
# The relative squared error each format gives on the demo's heavy-tailed table (0.74% and 0.07%),
# with headroom: above it, the quantizer has changed, not the draw.
DEMO_ERROR_BOUNDS = {"nvfp4": 1.5e-2, "fp8": 1.5e-3}
STAND_IN = ("vLLM's device-resident PLE backend on the CPU: the pinned-host backend that serves the table needs a "
            "CUDA driver (pinned memory, a UVA view) and reads the same tensors through a Triton gather of the same "
            "formula")
# The method vLLM must choose for each format's ple_embedding_dtype.
VLLM_METHODS = {"nvfp4": "Qwen4ExpPLENvFp4EmbeddingMethod", "fp8": "Qwen4ExpPLEFp8EmbeddingMethod"}
# Rows gathered per call of vLLM's embedding (its max_total_tokens).
GATHER_ROWS = 4096


# -- in the selftest's process --------------------------------------------------------------------

def build_views(snapshot, workdir: Path) -> dict[str, dict]:
    """Per format: the overlay ``flashnext ple build --format`` writes from ``snapshot`` (a
    :class:`~flashnext.quant.checkpoint.snapshot.Snapshot`, opened once for all of it) and a view of
    the snapshot with it (``overlay``, ``view``, ``report``), or why it could not be built (``error``)."""
    from flashnext.errors import FlashnextError
    from flashnext.quant.overlays.ple_quant import PleQuantize
    from flashnext.quant.overlays.view import OverlayStack, apply_overlays

    out = {}
    for fmt in FORMATS:
        overlay, view = workdir / f"ple-{fmt}", workdir / f"view-ple-{fmt}"
        try:
            report = PleQuantize(snapshot, fmt).build(overlay, progress=False)
            apply_overlays(snapshot.root, [overlay], view,
                           stack=OverlayStack(snapshot.root, [overlay], open_base=lambda: snapshot))
        except FlashnextError as e:
            out[fmt] = {"error": f"ple build --format {fmt}: {e}"}
            continue
        out[fmt] = {"overlay": str(overlay), "view": str(view), "report": report}
    return out


def _tensors(root, names) -> dict:
    """``names`` read from ``root``: a folder (its index read here) or a
    :class:`~flashnext.quant.checkpoint.snapshot.Snapshot` (its index as opened)."""
    from safetensors import safe_open

    if isinstance(root, Path):
        index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
        path_of = {name: root / index[name] for name in names}
    else:
        path_of = {name: root.path(root.weight_map[name]) for name in names}
    out = {}
    for name in names:
        with safe_open(str(path_of[name]), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def decoded_table(view: Path, source, fmt: str):
    """Every row of ``source``'s table (the BF16 snapshot's layout) as flashnext's decoder reads it
    from ``view``, in row order: what vLLM's method must return."""
    import torch

    from flashnext.quant.formats import float_rows

    base = f"{source.prefix}.ngram_embedding."
    parts = []
    scale_name = base + ("weight_scale_2" if fmt == "nvfp4" else "weight_scale")
    names = [scale_name]
    for shard in source.shards:
        names.append(shard.name)
        if fmt == "nvfp4":
            names.append(shard.name.removesuffix(".weight") + ".weight_scale")
    t = _tensors(view, names)
    scale = float(t[scale_name][0])
    for shard in source.shards:
        if fmt == "nvfp4":
            parts.append(float_rows.nvfp4_decode(t[shard.name], t[shard.name.removesuffix(".weight") + ".weight_scale"],
                                                 scale))
        else:
            parts.append(float_rows.fp8_decode(t[shard.name], scale))
    return torch.cat(parts)


def bf16_table(snapshot, source):
    import torch

    t = _tensors(snapshot, [s.name for s in source.shards])
    return torch.cat([t[s.name] for s in source.shards])


def judge(snapshot, built: dict[str, dict], read: dict | None, read_error: str | None):
    """The :class:`~.report.PleFormats` record: per format, vLLM's rows (``read``, from
    :func:`read_back`) against flashnext's decoder and against the BF16 rows of ``snapshot`` (the
    demo, a :class:`~flashnext.quant.checkpoint.snapshot.Snapshot`)."""
    import torch

    from flashnext.quant.checkpoint.snapshot import Snapshot
    from flashnext.quant.formats import float_rows
    from flashnext.quant.overlays.ple_quant import quantized_table_allocations
    from flashnext.quant.ple.source import find_ple_source
    from flashnext.serving.selftest.report import PleFormatCheck, PleFormats

    layers = snapshot.text_config.get("ple_layer_ids") or []
    sources = [find_ple_source(snapshot, i) for i in range(len(set(layers)))]
    checks = []
    for fmt in FORMATS:
        row = dict(format=fmt, ple_embedding_dtype=float_rows.FORMATS[fmt], vllm_method=None, vllm_backend=None,
                   rows=0, rows_differing=None, relative_mse=None, error_bound=DEMO_ERROR_BOUNDS[fmt],
                   allocated_bytes=[], preflight_bytes=[])
        b = built[fmt]
        if "error" in b:
            checks.append(PleFormatCheck(status="failed", detail=b["error"], **row))
            continue
        got = (read or {}).get(fmt)
        if got is None or "error" in got:
            why = got["error"] if got else (read_error or "vLLM's read-back gave no result")
            checks.append(PleFormatCheck(status="failed", detail=f"vLLM could not read the overlay: {why}", **row))
            continue
        row.update(vllm_method=got["method"], vllm_backend=got["backend"], allocated_bytes=sorted(got["allocated"]),
                   preflight_bytes=sorted(quantized_table_allocations(Snapshot.open(Path(b["view"])))))
        problems, squared, reference, differing, rows = [], 0.0, 0.0, 0, 0
        for source in sources:
            vllm_rows = torch.load(got["rows"][source.prefix], weights_only=True)
            ours = decoded_table(Path(b["view"]), source, fmt)
            bf16 = bf16_table(snapshot, source).float()
            if vllm_rows.shape != ours.shape:
                problems.append(f"{source.prefix}: vLLM returned {tuple(vllm_rows.shape)} rows, the table is "
                                f"{tuple(ours.shape)}")
                continue
            same = (vllm_rows.view(torch.int16) == ours.view(torch.int16)).all(dim=1)
            differing += int((~same).sum())
            if not same.all():
                first = int((~same).nonzero()[0])
                problems.append(f"{int((~same).sum())} of {len(same)} rows differ from flashnext's decoder "
                                f"(first: row {first} of {source.prefix})")
            rows += len(same)
            squared += float(((vllm_rows.float() - bf16) ** 2).sum())
            reference += float((bf16 ** 2).sum())
        relative = squared / reference if reference > 0 else None
        row.update(rows=rows, rows_differing=differing, relative_mse=relative)
        if row["vllm_method"] != VLLM_METHODS[fmt]:
            problems.append(f"vLLM chose {row['vllm_method']}, not {VLLM_METHODS[fmt]}")
        if relative is not None and relative > DEMO_ERROR_BOUNDS[fmt]:
            problems.append(f"relative squared error {relative:.3e} against BF16 is above "
                            f"{DEMO_ERROR_BOUNDS[fmt]:.1e}, what the format gives on the demo's table")
        if row["allocated_bytes"] != row["preflight_bytes"]:
            problems.append(f"vLLM allocates {row['allocated_bytes']} B for the table, the preflight counts "
                            f"{row['preflight_bytes']} B")
        if problems:
            checks.append(PleFormatCheck(status="failed", detail="; ".join(problems), **row))
        else:
            checks.append(PleFormatCheck(
                status="passed", detail=f"{rows} rows read by {row['vllm_method']} equal flashnext's decoder bit for "
                f"bit; relative squared error against BF16 {relative:.3e}", **row))
    failed = [c for c in checks if c.status == "failed"]
    if failed:
        detail = "; ".join(f"{c.format}: {c.detail}" for c in failed)
    else:
        detail = ", ".join(f"{c.format} {c.relative_mse:.2e}" for c in checks)
        detail = (f"vLLM's own PLE methods read both overlays bit for bit as flashnext decodes them; relative squared "
                  f"error against BF16 on the demo's table (not the real model's): {detail}")
    return PleFormats(status="failed" if failed else "passed", detail=detail, stand_in=STAND_IN, formats=checks)


# -- in the fresh vLLM interpreter ----------------------------------------------------------------

def read_back(request: dict, out_dir: Path) -> dict:
    """For each format of ``request`` (``{"snapshot": ..., "views": {fmt: view}}``), vLLM's PLE module
    built from the view's config loads the view's PLE tensors with its own ``load_weights`` and
    returns every row of each table through its own method (saved under ``out_dir``); with the
    method's and the backend's names and the bytes of each tensor the method asked its embedding
    to allocate (what patch host-pool pins, exact-size, in the served backend). The caller has set
    up vLLM's distributed state (one gloo rank)."""
    import torch
    from safetensors import safe_open
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEDeviceEmbedding
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    from flashnext.quant.checkpoint.snapshot import Snapshot
    from flashnext.quant.ple.source import find_ple_source

    snap = Snapshot.open(request["snapshot"])
    layers = snap.text_config.get("ple_layer_ids") or []
    sources = [find_ple_source(snap, i) for i in range(len(set(layers)))]
    # Record what the method asks the embedding to allocate, through vLLM's own allocation.
    owner = next(c for c in Qwen4ExpPLEDeviceEmbedding.__mro__ if "allocate_embedding_weight" in vars(c))
    allocate, asked = owner.allocate_embedding_weight, []

    def recording(self, rows, width, dtype):
        asked.append(rows * width * torch.empty((), dtype=dtype).element_size())
        return allocate(self, rows, width, dtype)

    results = {}
    owner.allocate_embedding_weight = recording
    try:
        for fmt, view in request["views"].items():
            asked.clear()
            try:
                model_config = ModelConfig(model=view, max_model_len=4096, skip_tokenizer_init=True, dtype="bfloat16")
                config = VllmConfig(model_config=model_config, cache_config=CacheConfig())
                config.engram_config.cpu_offload = False  # the device-resident backend: nothing to pin on the CPU
                index = json.loads((Path(view) / "model.safetensors.index.json").read_text())["weight_map"]
                rows_out = {}
                with set_current_vllm_config(config):
                    text = model_config.hf_text_config
                    for source in sources:
                        ple = Qwen4ExpNGramEmbedding(text, text.ple_embed_dim, 0, GATHER_ROWS, data_parallel_rank=0,
                                                     prefix="ple")
                        prefix = source.prefix + "."
                        weights = {}
                        for name in (n for n in index if n.startswith(prefix)):
                            with safe_open(str(Path(view) / index[name]), "pt") as f:
                                weights[name[len(prefix):]] = f.get_tensor(name)
                        ple.load_weights(weights.items())
                        table = ple.ngram_embedding
                        table.embedding_method.process_weights_after_loading(table)
                        ids = torch.arange(source.layout.padded_rows)
                        rows = torch.cat([table.dequantize(table(ids[i:i + GATHER_ROWS]), torch.bfloat16)
                                          for i in range(0, len(ids), GATHER_ROWS)])
                        path = out_dir / f"ple-{fmt}-{len(rows_out)}.pt"
                        torch.save(rows.contiguous(), path)
                        rows_out[source.prefix] = str(path)
                results[fmt] = {"method": type(table.embedding_method).__name__, "backend": type(table).__name__,
                                "allocated": list(asked), "rows": rows_out}
            except Exception as e:  # vLLM refusing the overlay is what this check reports
                results[fmt] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
    finally:
        owner.allocate_embedding_weight = allocate
    return results
