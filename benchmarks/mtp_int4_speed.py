"""End-to-end speed of ``make-mtp-int4`` on a synthetic full-size MTP expert set.

512 experts, H 2560, I 640, BF16 (4.69 GiB of experts, fused as the BF16 release stores them),
heavy-tailed, with a router and calibration activations (16,384 tokens with a few outlier
channels, top-10 routing: ~320 tokens an expert). Each run is the real command line in a subprocess,
with the source shard evicted from the page cache first (posix_fadvise DONTNEED), so a run reads the
shard from the drive; the child's peak resident set is recorded. Plain absmax RTN
(``--quantizer rtn``), the default MSE search, ``--calib`` and ``--calib --quantizer gptq`` run side
by side on the same device (``--modes`` picks).

    python -m benchmarks.mtp_int4_speed --device cpu|cuda [--workdir .bench] [--modes rtn,mse,calib,gptq]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from flashnext.quant.formats.ct_config import weight_scheme
from safetensors.torch import save_file

from flashnext.quant.formats.safetensors_io import ShardWriter, TensorSpec

E, H, I = 512, 2560, 640
CALIB_TOKENS = 16384
PREFIX = "mtp.layers.0.mlp.experts"
ROUTER = "mtp.layers.0.mlp.gate.weight"
CALIB = "calib.safetensors"
SHARD = "model-00001-of-00001.safetensors"


def build_snapshot(root: Path, device: str) -> Path:
    """A minimal snapshot: config.json, index, one shard with the fused MTP experts and a norm."""
    if (root / "model.safetensors.index.json").exists():
        return root
    tmp = root.with_name(root.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
              "text_config": {"model_type": "qwen4_exp_text", "hidden_size": H, "num_hidden_layers": 48,
                              "num_experts": E, "moe_intermediate_size": I, "num_experts_per_tok": 10},
              "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"group_0": weight_scheme(
                                          [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"], 4, 128)},
                                      "ignore": [r"re:^mtp\..*"]}}
    specs = [TensorSpec("mtp.pre_fc_norm_embedding.weight", "BF16", (H,)), TensorSpec(ROUTER, "BF16", (E, H)),
             TensorSpec(f"{PREFIX}.gate_up_proj", "BF16", (E, 2 * I, H)),
             TensorSpec(f"{PREFIX}.down_proj", "BF16", (E, H, I))]
    g = torch.Generator(device=device).manual_seed(1)

    def heavy(shape):
        z = torch.randn(shape, generator=g, device=device)
        return (0.02 * z * torch.exp(0.5 * torch.randn(shape, generator=g, device=device))).to(torch.bfloat16)

    with ShardWriter(tmp / SHARD, specs, {"format": "pt"}) as w:
        w.write("mtp.pre_fc_norm_embedding.weight", torch.ones(H, dtype=torch.bfloat16))
        w.write(ROUTER, (0.02 * torch.randn((E, H), generator=g, device=device)).to(torch.bfloat16).cpu())
        for name, shape in ((f"{PREFIX}.gate_up_proj", (2 * I, H)), (f"{PREFIX}.down_proj", (H, I))):
            per = shape[0] * shape[1] * 2
            for e in range(E):
                w.write_bytes(name, memoryview(heavy(shape).cpu().view(-1).view(torch.uint8).numpy()), e * per)
    scale = torch.ones(H, device=device)
    scale[torch.randperm(H, generator=g, device=device)[:32]] = 20.0
    hidden = torch.randn((CALIB_TOKENS, H), generator=g, device=device) * scale
    save_file({"hidden_states": hidden.to(torch.bfloat16).cpu()}, str(tmp / CALIB))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {s.name: SHARD for s in specs}}, indent=2))
    os.rename(tmp, root)
    return root


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(snapshot: Path, out: Path, device: str, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    evict(snapshot / SHARD)
    cmd = [sys.executable, "-m", "flashnext.tools.make_mtp_int4", "--src", str(snapshot), "--out", str(out),
           "--device", device, "--json", "--no-progress", *extra]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"make-mtp-int4 failed: {' '.join(cmd)}")
    report = json.loads(stdout)
    return {"wall_s": round(wall, 2), "read_gb_per_s": round(report["bytes_read"] / wall / 1e9, 3),
            "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),
            "rel_mse": {p: v["rel_mse"] for p, v in report["projections"].items()},
            "output_rel_mse": {p: v.get("output_rel_mse") for p, v in report["projections"].items()},
            "weight_only_output_rel_mse": {p: v.get("weight_only_output_rel_mse")
                                           for p, v in report["projections"].items()},
            "bytes_read": report["bytes_read"], "bytes_written": report["bytes_written"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--modes", default="rtn,mse,calib,gptq")
    args = parser.parse_args()
    modes = args.modes.split(",")
    args.workdir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    snapshot = build_snapshot(args.workdir / "mtp-full", "cuda" if args.device.startswith("cuda") else "cpu")
    built = time.perf_counter() - t
    results = {
        "machine": f"{platform.node()} {os.cpu_count()} cpus"
                   + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "device": args.device, "snapshot_build_s": round(built, 1),
    }
    calib = ["--calib", str(snapshot / CALIB)]
    runs = {"rtn": ("plain_rtn", ["--quantizer", "rtn"]), "mse": ("mse_search", []),
            "calib": ("calibrated", calib), "gptq": ("calibrated_gptq", [*calib, "--quantizer", "gptq"])}
    for mode in modes:
        if mode.startswith("gptq-prior-"):  # gptq-prior-N: --gptq-prior-tokens N
            runs[mode] = (mode.replace("-", "_"), [*calib, "--quantizer", "gptq", "--gptq-prior-tokens", mode[11:]])
        name, extra = runs[mode]
        results[name] = run(snapshot, args.workdir / f"out-{mode}", args.device, extra)
        print(name, results[name], file=sys.stderr, flush=True)
    if "plain_rtn" in results and "mse_search" in results:
        results["time_ratio_to_plain_rtn"] = round(results["mse_search"]["wall_s"] / results["plain_rtn"]["wall_s"], 2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
