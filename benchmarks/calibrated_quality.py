"""Calibrated INT4 g128 against the real AutoRound and llm-compressor, on output error (issue 17).

Real weights and real activations, from packages that ship them (``benchmarks/calibration_sets.py``):
all-MiniLM-L6-v2 on English text, and Whisper tiny.en (encoder and decoder) on English speech.
Side by side in one run, each method quantizes the same Linears symmetric INT4 group 128 from the
same calibration inputs:

* absmax RTN (compressed-tensors' observer) and flashnext's weight-only default (make-mtp-int4 today);
* flashnext calibrated (``diag(XᵀX)``-weighted scale search) and calibrated + GPTQ rounding;
* AutoRound (the real package) with ``iters=0`` (its default "OPT-RTN") and tuned (``iters=200``);
* llm-compressor's ``GPTQModifier`` W4A16 (the real package).

Reported, on held-out inputs: weight error; per-layer output error (each Linear on its own held-out
inputs, ``tr(ΔW G ΔWᵀ) / tr(W G Wᵀ)`` with ``G = XᵀX``, mean over layers); whole-model output error
(the model's last hidden state, every Linear quantized); for Whisper, the share of the full-precision
model's held-out transcript tokens it still predicts; each error also as a ratio to absmax RTN; and
the time each method took.

The packages pin other versions of compressed-tensors and transformers than flashnext does, so
this runs in its own venv (docs/benchmarks.md has the commands)::

    python -m benchmarks.calibrated_quality [--sets minilm,whisper-tiny-en] [--iters 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from benchmarks.calibration_sets import WEIGHT_SETS
from flashnext.quant.quantizers.calibration import gram_importance
from flashnext.quant.quantizers.gptq import gptq_codes
from flashnext.quant.quantizers.mse_rtn import (
    MseSearch, calibrated_grid, dequantize, quantize_absmax_rtn, quantize_mse_rtn,
)

GROUP = 128


def ours(weights: dict[str, torch.Tensor], grams: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    out = {}
    for n, w in weights.items():
        if mode == "absmax":
            q = quantize_absmax_rtn(w)
        elif mode == "weight-only":
            q = quantize_mse_rtn(w)
        else:
            gram = grams[n].float()
            q = quantize_mse_rtn(w, importance=gram_importance(gram), search=MseSearch(grid=calibrated_grid()))
            if mode == "gptq":
                codes = gptq_codes(w[None], gram[None], q.scale[None], GROUP)[0]
                q = type(q)(codes, q.scale, GROUP)
        out[n] = dequantize(q.codes, q.scale, GROUP).float()
    return out


def layer_error(w: torch.Tensor, q: torch.Tensor, gram: torch.Tensor) -> float:
    """``‖XΔWᵀ‖² / ‖XWᵀ‖²`` over the inputs whose Gram matrix is ``gram``."""
    w, d = w.double(), (q - w).double()
    return float(((d @ gram) * d).sum() / ((w @ gram) * w).sum())


def run_set(key: str, iters: int) -> tuple[object, dict[str, dict]]:
    ws = WEIGHT_SETS[key]()
    print(f"== {ws.name}: {ws.description}", flush=True)
    weights = {n: m.weight.data.clone() for n, m in ws.linears.items()}
    t = time.perf_counter()
    calib = ws.grams("calib")
    capture_s = time.perf_counter() - t
    held = ws.grams("held")
    exact = ws.output("held")
    methods = {
        "absmax RTN": lambda: ours(weights, calib, "absmax"),
        "flashnext weight-only (default)": lambda: ours(weights, calib, "weight-only"),
        "flashnext calibrated": lambda: ours(weights, calib, "calibrated"),
        "flashnext calibrated + GPTQ": lambda: ours(weights, calib, "gptq"),
        "AutoRound iters=0": lambda: ws.autoround(0),
        f"AutoRound iters={iters}": lambda: ws.autoround(iters),
        "llm-compressor GPTQ W4A16": ws.llmcompressor_gptq,
    }
    rows = {}
    for name, method in methods.items():
        t = time.perf_counter()
        q = method()
        seconds = time.perf_counter() - t + (capture_s if name.startswith("flashnext calibrated") else 0.0)
        missing = set(weights) - set(q)
        if missing:
            raise SystemExit(f"{ws.name}, {name}: no weights for {sorted(missing)[:3]}")
        w_err = sum(float((q[n] - w).square().sum()) for n, w in weights.items()) / sum(
            float(w.square().sum()) for w in weights.values())
        per_layer = [layer_error(w, q[n], held[n]) for n, w in weights.items()]
        with torch.no_grad():
            for n, m in ws.linears.items():
                m.weight.copy_(q[n])
            got = ws.output("held")
            task = ws.transcripts_agree("held") if hasattr(ws, "transcripts_agree") else None
            for n, m in ws.linears.items():
                m.weight.copy_(weights[n])
        rows[name] = {"weight": w_err, "per_layer": sum(per_layer) / len(per_layer),
                      "whole_model": float((got - exact).square().sum() / exact.square().sum()),
                      "task": task, "seconds": seconds}
        print(f"{name}: {rows[name]}", flush=True)
    return ws, rows


def table(ws, rows: dict[str, dict]) -> str:
    base = rows["absmax RTN"]
    task = any(r["task"] is not None for r in rows.values())
    lines = [f"{ws.name}: {ws.description}",
             "| method | weight rel MSE | x absmax | per-layer output | x absmax | whole-model output | x absmax |"
             + (" transcript tokens kept |" if task else "") + " seconds |",
             "|---|---|---|---|---|---|---|" + ("---|" if task else "") + "---|"]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['weight']:.4e} | {r['weight'] / base['weight']:.3f} | {r['per_layer']:.4e} | "
            f"{r['per_layer'] / base['per_layer']:.3f} | {r['whole_model']:.4e} | "
            f"{r['whole_model'] / base['whole_model']:.3f} |" + (f" {r['task']:.1%} |" if task else "")
            + f" {r['seconds']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", default=",".join(WEIGHT_SETS), help=f"weight sets, of {', '.join(WEIGHT_SETS)}")
    ap.add_argument("--iters", type=int, default=200, help="AutoRound's tuned mode")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    keys = [k.strip() for k in args.sets.split(",") if k.strip()]
    unknown = [k for k in keys if k not in WEIGHT_SETS]
    if unknown:
        ap.error(f"unknown weight set {unknown[0]!r}; choose from {', '.join(WEIGHT_SETS)}")
    torch.manual_seed(0)
    results, tables = {}, []
    for key in keys:
        ws, rows = run_set(key, args.iters)
        results[key] = rows
        tables.append(table(ws, rows))
    print(f"\n{platform.node()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for t in tables:
        print("\n" + t)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
