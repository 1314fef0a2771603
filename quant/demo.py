"""A miniature Qwen3.8-Flash-Next snapshot, byte-identical on every build.

It has the real model's tensor names, dtypes, config.json keys (top-level ``qwen4_exp`` with a
``text_config``) and the compressed-tensors layout of the INT4/INT6-mixed release, at small sizes:

* routed experts INT4 g128;
* linear-attention in/out, QSA q/k/v/o and the shared expert INT6 g64 (dense 6-bit packing);
* hyper-connection mixers INT8 g64;
* lm_head, embed_tokens, PLE key/value projections and the QSA indexer INT8 g128;
* the PLE table shards, routers, vision tower and every MTP module BF16, kept out by ``ignore``.

The MTP routed experts are stored fused, as the BF16 release stores them:
``mtp.layers.0.mlp.experts.gate_up_proj [E, 2I, H]`` and ``...experts.down_proj [E, H, I]``.

Weights are heavy-tailed (a Gaussian scale mixture with per-row magnitudes) so that quantization
tests mean something. The random numbers come from SplitMix64 over a counter, so the bytes do
not depend on a library's random generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from flashnext import __version__
from flashnext.quant.checkpoint.fsutil import atomic_directory, output_file, write_json, write_new
from flashnext.quant.ple.layout import SPLITMIX_GAMMA, SPLITMIX_M1, SPLITMIX_M2, ple_layout
from flashnext.quant.formats.safetensors_io import ShardWriter, TensorSpec, spec_of
from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, INDEX_FILE

if TYPE_CHECKING:
    import torch

MADE_BY = "demo-checkpoint"  # the command, in its output's marker: only its --force replaces the snapshot
TEXT = "model.language_model"

DEMO_TEXT_CONFIG: dict = {
    "model_type": "qwen4_exp_text",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "output_gate_type": "sigmoid",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "mrope_interleaved": True, "mrope_section": [3, 3, 2]},
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 32,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "norm_topk_prob": True,
    "hc_count": 4,
    "hc_lowrank": 64,
    "ple_layer_ids": [2],
    "ple_embed_dim": 256,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 1000,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 4,
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "vocab_size": 4096,
    "eos_token_id": 4000,
    "bos_token_id": 4000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

DEMO_VISION_CONFIG: dict = {"depth": 1, "hidden_size": 64, "intermediate_size": 128,
                            "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                            "out_hidden_size": 256, "in_channels": 3, "temporal_patch_size": 2,
                            "deepstack_visual_indexes": []}

# Release-style compressed-tensors layout; targets are generic (they would also match the MTP
# head), so the MTP head is kept BF16 by ``ignore`` alone, as in the release.
EXPERTS_INT4 = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
INT6_TARGETS = [r"re:.*linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$",
                r"re:.*self_attn\.(q|k|v|o)_proj$",
                r"re:.*mlp\.shared_expert\.(gate|up|down)_proj$"]
INT8_G64_TARGETS = [r"re:.*hyper_connection(_mixer)?\.(input_mix_weight_down|block_inject_weight|input_mix_weight_up)$"]
INT8_G128_TARGETS = ["lm_head", r"re:.*embed_tokens$", r"re:.*ple\.(key|value)_proj$",
                     r"re:.*indexer\.index_qk_proj$"]
DEMO_IGNORE = [r"re:.*ple_embedding\.ngram_embedding\..*", r"re:.*mlp\.gate$",
               r"re:.*shared_expert_gate$", r"re:^model\.visual\..*", r"re:^mtp\..*"]

# (format name) -> (bits, group size); None is BF16
FORMATS = {"int4g128": (4, 128), "int6g64": (6, 64), "int8g64": (8, 64), "int8g128": (8, 128)}


def demo_quantization_config() -> dict:
    from flashnext.quant.formats.ct_config import weight_scheme

    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "version": "0.18.0",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": weight_scheme([EXPERTS_INT4], 4, 128),
            "group_1": weight_scheme(INT6_TARGETS, 6, 64),
            "group_2": weight_scheme(INT8_G64_TARGETS, 8, 64),
            "group_3": weight_scheme(INT8_G128_TARGETS, 8, 128),
        },
        "ignore": list(DEMO_IGNORE),
    }


def demo_config() -> dict:
    text = DEMO_TEXT_CONFIG
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "text_config": dict(text),
        "vision_config": dict(DEMO_VISION_CONFIG),
        "image_token_id": 4056, "video_token_id": 4057,
        "vision_start_token_id": 4053, "vision_end_token_id": 4054,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": demo_quantization_config(),
    }


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    z = x + np.uint64(SPLITMIX_GAMMA)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(SPLITMIX_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(SPLITMIX_M2)
    return z ^ (z >> np.uint64(31))


def _uniform(stream: int, n: int) -> np.ndarray:
    """n uniforms in (0, 1) from SplitMix64 over counters ``stream * 2**40 + i``."""
    counters = np.arange(n, dtype=np.uint64) + np.uint64((stream << 40) & ((1 << 64) - 1))
    bits = _splitmix64_array(counters) >> np.uint64(11)
    return (bits.astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def heavy_tailed(stream: int, shape: tuple[int, ...], std: float = 0.02) -> torch.Tensor:
    """Deterministic heavy-tailed weights: Gaussian x lognormal scale, times per-row magnitudes."""
    n = math.prod(shape)
    u1, u2, u3, u4 = (_uniform(stream * 4 + k, n) for k in range(4))
    radius = np.sqrt(-2.0 * np.log(u1))
    z = radius * np.cos(2.0 * np.pi * u2)
    mix = np.sqrt(-2.0 * np.log(u3)) * np.cos(2.0 * np.pi * u4)
    w = z * np.exp(0.5 * mix)
    rows = shape[-2] if len(shape) >= 2 else 1
    row_scale = np.exp(0.3 * np.sqrt(-2.0 * np.log(_uniform(stream * 4 + 3, rows)))
                       * np.cos(2.0 * np.pi * _uniform(stream * 4 + 2, rows)))
    if len(shape) >= 2:
        w = w.reshape(-1, rows, shape[-1]) * row_scale[None, :, None]
    w = (w * std).astype(np.float32).reshape(shape)
    import torch

    return torch.from_numpy(w).to(torch.bfloat16)


@dataclass(frozen=True)
class PlannedTensor:
    """One logical weight of the demo checkpoint (a module weight or a raw tensor)."""

    name: str  # module name for quantized weights, full tensor name otherwise
    shape: tuple[int, ...]
    fmt: str | None = None  # a FORMATS key, "int64" for buffers, None for BF16
    values: tuple[int, ...] | None = None  # for int64 buffers


def _module_weights(prefix: str, c: dict, layer: int, layer_type: str) -> list[PlannedTensor]:
    H = c["hidden_size"]
    hc = c["hc_count"] * H
    low = c["hc_lowrank"]
    p = f"{prefix}.layers.{layer}"
    out: list[PlannedTensor] = []
    for hcname in ("attn_hyper_connection", "mlp_hyper_connection"):
        out += [PlannedTensor(f"{p}.{hcname}.hc_norm.weight", (hc,)),
                PlannedTensor(f"{p}.{hcname}.input_mix_weight_down", (low, hc), "int8g64"),
                PlannedTensor(f"{p}.{hcname}.block_inject_weight", (c["hc_count"], hc), "int8g64"),
                PlannedTensor(f"{p}.{hcname}.input_mix_weight_up", (hc, low), "int8g64")]
    if layer_type == "linear_attention":
        nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        qkv = 2 * nk * dk + nv * dv
        a = f"{p}.linear_attn"
        out += [PlannedTensor(f"{a}.in_proj_qkv", (qkv, H), "int6g64"),
                PlannedTensor(f"{a}.in_proj_z", (nv * dv, H), "int6g64"),
                PlannedTensor(f"{a}.in_proj_b.weight", (nv, H)),
                PlannedTensor(f"{a}.in_proj_a.weight", (nv, H)),
                PlannedTensor(f"{a}.conv1d.weight", (qkv, 1, c["linear_conv_kernel_dim"])),
                PlannedTensor(f"{a}.A_log", (nv,)),
                PlannedTensor(f"{a}.dt_bias", (nv,)),
                PlannedTensor(f"{a}.norm.weight", (dv,)),
                PlannedTensor(f"{a}.out_proj", (H, nv * dv), "int6g64")]
    else:
        out += _qsa_weights(f"{p}.self_attn", c, quantized=True)
    out += _moe_weights(f"{p}.mlp", c, quantized=True)
    if layer + 1 in c["ple_layer_ids"]:
        out += _ple_weights(f"{p}.ple", c)
    return out


def _qsa_weights(a: str, c: dict, quantized: bool) -> list[PlannedTensor]:
    H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    fmt, suffix = ("int6g64", "") if quantized else (None, ".weight")
    idx_fmt = "int8g128" if quantized else None
    idx_out = (c["indexer_n_heads"] + c["indexer_kv_heads"]) * c["indexer_head_dim"]
    return [PlannedTensor(f"{a}.q_proj{suffix}", (2 * nh * hd, H), fmt),
            PlannedTensor(f"{a}.k_proj{suffix}", (nkv * hd, H), fmt),
            PlannedTensor(f"{a}.v_proj{suffix}", (nkv * hd, H), fmt),
            PlannedTensor(f"{a}.o_proj{suffix}", (H, nh * hd), fmt),
            PlannedTensor(f"{a}.q_norm.weight", (hd,)),
            PlannedTensor(f"{a}.k_norm.weight", (hd,)),
            PlannedTensor(f"{a}.indexer.index_qk_proj{suffix}", (idx_out, H), idx_fmt),
            PlannedTensor(f"{a}.indexer.q_layernorm.weight", (c["indexer_head_dim"],)),
            PlannedTensor(f"{a}.indexer.k_layernorm.weight", (c["indexer_head_dim"],))]


def _moe_weights(m: str, c: dict, quantized: bool) -> list[PlannedTensor]:
    H, I, S, E = (c["hidden_size"], c["moe_intermediate_size"],
                  c["shared_expert_intermediate_size"], c["num_experts"])
    out = [PlannedTensor(f"{m}.gate.weight", (E, H)),
           PlannedTensor(f"{m}.shared_expert_gate.weight", (1, H))]
    if quantized:
        for e in range(E):
            out += [PlannedTensor(f"{m}.experts.{e}.gate_proj", (I, H), "int4g128"),
                    PlannedTensor(f"{m}.experts.{e}.up_proj", (I, H), "int4g128"),
                    PlannedTensor(f"{m}.experts.{e}.down_proj", (H, I), "int4g128")]
        out += [PlannedTensor(f"{m}.shared_expert.gate_proj", (S, H), "int6g64"),
                PlannedTensor(f"{m}.shared_expert.up_proj", (S, H), "int6g64"),
                PlannedTensor(f"{m}.shared_expert.down_proj", (H, S), "int6g64")]
    else:
        # The BF16 release stores the MTP routed experts fused.
        out += [PlannedTensor(f"{m}.experts.gate_up_proj", (E, 2 * I, H)),
                PlannedTensor(f"{m}.experts.down_proj", (E, H, I)),
                PlannedTensor(f"{m}.shared_expert.gate_proj.weight", (S, H)),
                PlannedTensor(f"{m}.shared_expert.up_proj.weight", (S, H)),
                PlannedTensor(f"{m}.shared_expert.down_proj.weight", (H, S))]
    return out


def _ple_weights(p: str, c: dict) -> list[PlannedTensor]:
    H, hc = c["hidden_size"], c["hc_count"] * c["hidden_size"]
    d = c["ple_embed_dim"]
    layout = ple_layout(c, 0)
    out = [PlannedTensor(f"{p}.key_proj", (hc, d), "int8g128"),
           PlannedTensor(f"{p}.value_proj", (H, d), "int8g128"),
           PlannedTensor(f"{p}.norm_key.weight", (hc,)),
           PlannedTensor(f"{p}.norm_query.weight", (hc,)),
           PlannedTensor(f"{p}.norm_conv.weight", (hc,)),
           PlannedTensor(f"{p}.conv1d.weight", (hc, 1, c["ple_conv_kernel_size"]))]
    e = f"{p}.ple_embedding"
    for i in range(layout.split_parts):
        begin, end = layout.shard_range(i)
        out.append(PlannedTensor(f"{e}.ngram_embedding.shard_{i}.weight", (end - begin, layout.head_dim)))
    out += [PlannedTensor(f"{e}.layer_multipliers", (len(layout.multipliers),), "int64", layout.multipliers),
            PlannedTensor(f"{e}.ngram_heads_vocab_sizes", (layout.num_heads,), "int64", layout.head_sizes),
            PlannedTensor(f"{e}.ngram_heads_offsets", (layout.num_heads,), "int64", layout.head_offsets)]
    return out


def _mtp_weights(c: dict) -> list[PlannedTensor]:
    H, hc, low = c["hidden_size"], c["hc_count"] * c["hidden_size"], c["hc_lowrank"]
    out = [PlannedTensor("mtp.fc_embedding.weight", (H, H)),
           PlannedTensor("mtp.fc_hidden.weight", (H, H)),
           PlannedTensor("mtp.pre_fc_norm_embedding.weight", (H,)),
           PlannedTensor("mtp.pre_fc_norm_hidden.weight", (hc,))]  # over the [T, hc_count*H] multi stream
    out += _qsa_weights("mtp.layers.0.self_attn", c, quantized=False)
    out += _moe_weights("mtp.layers.0.mlp", c, quantized=False)
    for hcname in ("attn_hyper_connection", "mlp_hyper_connection"):
        out += [PlannedTensor(f"mtp.layers.0.{hcname}.hc_norm.weight", (hc,)),
                PlannedTensor(f"mtp.layers.0.{hcname}.input_mix_weight_down.weight", (low, hc)),
                PlannedTensor(f"mtp.layers.0.{hcname}.block_inject_weight.weight", (c["hc_count"], hc)),
                PlannedTensor(f"mtp.layers.0.{hcname}.input_mix_weight_up.weight", (hc, low))]
    out += [PlannedTensor("mtp.hyper_connection_mixer.hc_norm.weight", (hc,)),
            PlannedTensor("mtp.hyper_connection_mixer.input_mix_weight_down.weight", (low, hc)),
            PlannedTensor("mtp.hyper_connection_mixer.input_mix_weight_up.weight", (hc, low))]
    return out


def _vision_weights(v: dict) -> list[PlannedTensor]:
    D, F = v["hidden_size"], v["intermediate_size"]
    merged = D * v["spatial_merge_size"] ** 2
    out = [PlannedTensor("model.visual.patch_embed.proj.weight",
                         (D, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"]))]
    for b in range(v["depth"]):
        q = f"model.visual.blocks.{b}"
        out += [PlannedTensor(f"{q}.norm1.weight", (D,)), PlannedTensor(f"{q}.norm2.weight", (D,)),
                PlannedTensor(f"{q}.attn.qkv.weight", (3 * D, D)),
                PlannedTensor(f"{q}.attn.proj.weight", (D, D)),
                PlannedTensor(f"{q}.mlp.linear_fc1.weight", (F, D)),
                PlannedTensor(f"{q}.mlp.linear_fc2.weight", (D, F))]
    out += [PlannedTensor("model.visual.merger.norm.weight", (D,)),
            PlannedTensor("model.visual.merger.linear_fc1.weight", (merged, merged)),
            PlannedTensor("model.visual.merger.linear_fc2.weight", (v["out_hidden_size"], merged))]
    return out


def plan_shards(config: dict) -> dict[str, list[PlannedTensor]]:
    """Which weights go in which shard, in order."""
    c = config["text_config"]
    V, H = c["vocab_size"], c["hidden_size"]
    hc, low = c["hc_count"] * H, c["hc_lowrank"]
    layers = [_module_weights(TEXT, c, i, t) for i, t in enumerate(c["layer_types"])]
    ple = [t for t in layers[1] if ".ple." in t.name and "ngram_embedding" in t.name]
    layers[1] = [t for t in layers[1] if t not in ple]
    head = [PlannedTensor(f"{TEXT}.hyper_connection_mixer.hc_norm.weight", (hc,)),
            PlannedTensor(f"{TEXT}.hyper_connection_mixer.input_mix_weight_down", (low, hc), "int8g64"),
            PlannedTensor(f"{TEXT}.hyper_connection_mixer.input_mix_weight_up", (hc, low), "int8g64"),
            PlannedTensor(f"{TEXT}.norm.weight", (H,)),
            PlannedTensor("lm_head", (V, H), "int8g128")]
    n = 5
    name = lambda i: f"model-{i:05d}-of-{n:05d}.safetensors"  # noqa: E731
    return {
        name(1): [PlannedTensor(f"{TEXT}.embed_tokens", (V, H), "int8g128")] + layers[0] + layers[1],
        name(2): layers[2] + layers[3],
        name(3): ple,
        name(4): _vision_weights(config["vision_config"]),
        # The draft head shares its shard with the main model's output head, so an overlay that
        # replaces this shard must carry the other tensors through unchanged.
        name(5): head + _mtp_weights(c),
    }


def _materialise(t: PlannedTensor, stream: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one planned weight."""
    import torch

    from flashnext.quant.formats.packing import pack_int32
    from flashnext.quant.quantizers.mse_rtn import quantize_absmax_rtn

    if t.fmt == "int64":
        return {t.name: torch.tensor(t.values, dtype=torch.int64)}
    if t.name.endswith(("norm.weight", "A_log", "dt_bias")):
        w = (1.0 + heavy_tailed(stream, t.shape, std=0.05).float()).to(torch.bfloat16)
        return {t.name: w}
    w = heavy_tailed(stream, t.shape)
    if t.fmt is None:
        return {t.name: w}
    bits, gs = FORMATS[t.fmt]
    q = quantize_absmax_rtn(w.float(), bits=bits, group_size=gs)
    return {f"{t.name}.weight_packed": pack_int32(q.codes, bits),
            f"{t.name}.weight_scale": q.scale,
            f"{t.name}.weight_shape": torch.tensor(list(t.shape), dtype=torch.int64)}


def write_demo_checkpoint(out: Path, force: bool = False) -> dict:
    """Build the demo snapshot at ``out`` (atomically). Returns a short summary."""
    config = demo_config()
    shards = plan_shards(config)
    weight_map: dict[str, str] = {}
    total = 0
    stream = 0
    with atomic_directory(Path(out), force=force, made_by=MADE_BY, held=True) as tmp:
        for filename, planned in shards.items():
            tensors: dict[str, torch.Tensor] = {}
            for t in planned:
                stream += 1
                tensors.update(_materialise(t, stream))
            specs: list[TensorSpec] = [spec_of(k, v) for k, v in tensors.items()]
            with ShardWriter(output_file(tmp, filename), specs, {"format": "pt"}) as writer:
                for k, v in tensors.items():
                    writer.write(k, v)
            for k, v in tensors.items():
                weight_map[k] = filename
                total += v.numel() * v.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_json(tmp / INDEX_FILE, index)
        write_json(tmp / CONFIG_FILE, config)
        write_json(tmp / "generation_config.json",
                   {"bos_token_id": config["text_config"]["bos_token_id"],
                    "eos_token_id": config["text_config"]["eos_token_id"],
                    "temperature": 1.0, "top_p": 0.95, "top_k": 20})
        write_new(tmp / "README.md",
                  f"# flashnext demo checkpoint\n\nA miniature Qwen3.8-Flash-Next snapshot made by "
                  f"flashnext {__version__} (`flashnext demo-checkpoint`). Random weights; real names, "
                  "dtypes and quantization layout.\n")
    return {"path": str(Path(out)), "shards": len(shards), "tensors": len(weight_map),
            "total_size": total}
