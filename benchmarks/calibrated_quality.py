"""Calibrated INT4 g128 against the real AutoRound and llm-compressor, on output error (issue 17).

Real weights and real activations, from packages that ship them (``benchmarks/calibration_sets.py``):
all-MiniLM-L6-v2 on English text, and Whisper tiny.en (encoder and decoder) on English speech.
Side by side in one run, each method quantizes the same Linears symmetric INT4 group 128 from the
same calibration inputs:

* absmax RTN (compressed-tensors' observer) and flashnext's weight-only default (make-mtp-int4 today);
* flashnext calibrated (``diag(XᵀX)``-weighted scale search) and calibrated + GPTQ rounding;
* AutoRound (the real package) with ``iters=0`` (its default "OPT-RTN") and tuned (``iters=200``);
* llm-compressor's ``GPTQModifier`` W4A16 (the real package).

Every method's output is checked before it is scored (:func:`check_int4_grid`, the same check for
flashnext's methods and the packages'): each weight must lie on a symmetric INT4 group-128 grid and
differ from the original. A method that fails it, raises, or leaves a Linear out is reported as
failed, with the reason, and not scored; the run then exits 1 after printing the tables.

Reported, on held-out inputs: weight error; per-layer output error (each Linear on its own held-out
inputs, ``tr(ΔW G ΔWᵀ) / tr(W G Wᵀ)`` with ``G = XᵀX``, mean over layers); whole-model output error
(the model's last hidden state, every Linear quantized); for Whisper, the share of the full-precision
model's held-out transcript tokens it still predicts; each error also as a ratio to absmax RTN; and
the time each method took.

The packages pin other versions of compressed-tensors and transformers than flashnext does, so
this runs in its own venv (docs/benchmarks.md has the commands)::

    python -m benchmarks.calibrated_quality [--sets minilm,whisper-tiny-en] [--iters 200] [--methods M,...]
                                            [--json FILE]
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
LEVELS = 16  # INT4


def check_int4_grid(original: torch.Tensor, quantized: torch.Tensor, group: int = GROUP,
                    rel: float = 2 ** -7) -> str | None:
    """Why ``quantized`` is not a symmetric INT4 quantization of ``original`` in groups of ``group``
    consecutive input values, or None when it is.

    It must have the original's shape, be finite and differ from the original (a weight identical
    to the original is always a failure, even if the original happens to lie on a grid). Each group
    must hold at most 16 distinct values, and one scale ``s`` per group must give them all as
    ``c * s`` with integer codes ``c`` in ``[-8, 7]`` (a negative scale, as flashnext and AutoRound
    use, is the same as codes in ``[-7, 8]`` of ``|s|``), reconstructing each value within
    ``rel * |c * s|`` (2**-7: two bf16 ulps, so that a product rounded to the bf16 of the scale,
    as compressed-tensors and flashnext compute it, passes) plus 1e-12 of the group's largest value.

    The scale is found from the data: the value of largest magnitude ``m`` is ``k * s`` for some
    ``k`` in 1..8, so each candidate ``s = m / k`` is tried, its codes are rounded, and ``s`` is
    refit to them by least squares before the residual is checked."""
    if quantized.shape != original.shape:
        return f"shape {tuple(quantized.shape)}, not {tuple(original.shape)}"
    if original.shape[-1] % group:
        return f"{original.shape[-1]} input columns are not a multiple of the group size {group}"
    if not bool(torch.isfinite(quantized).all()):
        return "non-finite values"
    if torch.equal(quantized.to(original.dtype), original):
        return "identical to the original weight (not quantized)"
    cols = quantized.shape[-1]
    v = quantized.detach().double().cpu().reshape(-1, group)

    def where(g: int) -> str:
        r, c = divmod(g * group, cols)
        return f"group (row {r}, columns {c}..{c + group - 1})"

    ordered = v.sort(dim=1).values
    levels = 1 + (ordered.diff(dim=1) != 0).sum(dim=1)
    if int(levels.max()) > LEVELS:
        g = int(levels.argmax())
        return f"{where(g)} has {int(levels[g])} distinct values, more than {LEVELS}"
    m = v.abs().amax(dim=1, keepdim=True)
    fits = m.squeeze(1) == 0  # an all-zero group is on every grid
    for k in range(1, LEVELS // 2 + 1):
        s0 = torch.where(m == 0, torch.ones_like(m), m / k)
        c = (v / s0).round()
        s = (v * c).sum(dim=1, keepdim=True) / (c * c).sum(dim=1, keepdim=True).clamp_min(1)
        in_range = ((c >= -LEVELS // 2) & (c <= LEVELS // 2 - 1)).all(dim=1) | \
                   ((c >= -(LEVELS // 2 - 1)) & (c <= LEVELS // 2)).all(dim=1)
        close = ((v - c * s).abs() <= rel * (c * s).abs() + 1e-12 * m).all(dim=1)
        fits |= in_range & close
        if bool(fits.all()):
            return None
    g = int((~fits).nonzero()[0])
    return (f"{where(g)}: no one scale puts its {int(levels[g])} values on the 16 levels of a symmetric "
            "INT4 grid (off-grid values, or more than one scale in the group)")


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


def quantization_failure(weights: dict[str, torch.Tensor], q: dict[str, torch.Tensor]) -> str | None:
    """Why a method's weights cannot be scored (:func:`check_int4_grid` on every Linear, and none
    left out), or None."""
    missing = sorted(set(weights) - set(q))
    if missing:
        return f"no weights for {len(missing)} Linears ({', '.join(missing[:3])})"
    for n, w in weights.items():
        why = check_int4_grid(w, q[n])
        if why:
            return f"{n}: {why}"
    return None


def run_set(key: str, iters: int, only: list[str] | None = None) -> tuple[object, dict[str, dict]]:
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
    if only:
        methods = {n: m for n, m in methods.items()
                   if n == "absmax RTN" or any(n.lower().startswith(o.lower()) for o in only)}
    rows = {}
    for name, method in methods.items():
        t = time.perf_counter()
        try:
            q = method()
        except Exception as e:  # a package that breaks is a failed method, not a lost run
            rows[name] = {"failed": f"raised {type(e).__name__}: {e}"}
            print(f"{name}: FAILED, {rows[name]['failed']}", flush=True)
            continue
        seconds = time.perf_counter() - t + (capture_s if name.startswith("flashnext calibrated") else 0.0)
        failure = quantization_failure(weights, q)
        if failure:
            rows[name] = {"failed": failure, "seconds": seconds}
            print(f"{name}: FAILED, {failure}", flush=True)
            continue
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
    if "failed" in base:
        raise SystemExit(f"{ws.name}: absmax RTN, the reference of every ratio, failed: {base['failed']}")
    task = any(r.get("task") is not None for r in rows.values())
    columns = 7 + (1 if task else 0)
    lines = [f"{ws.name}: {ws.description}",
             "| method | weight rel MSE | x absmax | per-layer output | x absmax | whole-model output | x absmax |"
             + (" transcript tokens kept |" if task else "") + " seconds |",
             "|---|---|---|---|---|---|---|" + ("---|" if task else "") + "---|"]
    for name, r in rows.items():
        if "failed" in r:
            seconds = f" {r['seconds']:.1f} |" if "seconds" in r else " — |"
            reason = " ".join(r["failed"].replace("|", "/").split())
            lines.append(f"| {name} | **failed, not scored**: {reason} |" + " |" * (columns - 2) + seconds)
            continue
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
    ap.add_argument("--methods", default="", help="only these methods (comma-separated name prefixes, e.g. "
                    "'AutoRound iters=0'); absmax RTN, the reference of the ratios, always runs")
    args = ap.parse_args()
    keys = [k.strip() for k in args.sets.split(",") if k.strip()]
    unknown = [k for k in keys if k not in WEIGHT_SETS]
    if unknown:
        ap.error(f"unknown weight set {unknown[0]!r}; choose from {', '.join(WEIGHT_SETS)}")
    torch.manual_seed(0)
    results, tables = {}, []
    for key in keys:
        ws, rows = run_set(key, args.iters, [m.strip() for m in args.methods.split(",") if m.strip()])
        results[key] = rows
        tables.append(table(ws, rows))
    print(f"\n{platform.node()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    for t in tables:
        print("\n" + t)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    failed = [f"{key}: {name}" for key, rows in results.items() for name, r in rows.items() if "failed" in r]
    if failed:
        raise SystemExit("failed, not scored: " + "; ".join(failed))


if __name__ == "__main__":
    main()
