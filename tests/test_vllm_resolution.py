"""vLLM 0.33.0 itself, imported on the CPU, resolves every module of the overlay's config."""

import copy
import json
import re

import pytest

from flashnext.quant.ct_config import with_mtp_experts_quantized
from flashnext.quant.demo_checkpoint import DEMO_TEXT_CONFIG, demo_quantization_config

vllm_ct = pytest.importorskip(
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    reason="vLLM 0.33.0 is installed by .ci/run")
from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (  # noqa: E402
    WNA16_SUPPORTED_BITS)

DRAFT_LAYER = DEMO_TEXT_CONFIG["num_hidden_layers"]  # vLLM's mtp.layers.{num_hidden_layers}
SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight")


def module_names(weight_map: dict) -> list[str]:
    names = set()
    for tensor in weight_map:
        for suffix in SUFFIXES:
            if tensor.endswith(suffix):
                names.add(tensor[: -len(suffix)])
    # The fused BF16 experts load per expert; vLLM asks for expert 0's projections.
    for tensor in weight_map:
        if m := re.match(r"(mtp\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", tensor):
            names |= {f"{m[1]}.0.gate_proj", f"{m[1]}.0.up_proj", f"{m[1]}.0.down_proj"}
    # vLLM looks the draft layer up under index num_hidden_layers, not 0.
    names |= {re.sub(r"^mtp\.layers\.0\.", f"mtp.layers.{DRAFT_LAYER}.", n) for n in names}
    return sorted(names)


def resolve(qc: dict, name: str):
    config = vllm_ct.CompressedTensorsConfig.from_config(copy.deepcopy(qc))
    scheme = config.get_scheme_dict(None, layer_name=name)
    if scheme is None:
        return None, config
    w = scheme["weights"]
    return (w.num_bits, w.group_size, str(w.strategy), w.symmetric, scheme["format"]), config


def is_mtp_expert(name: str) -> bool:
    return re.match(r"mtp\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj$", name) is not None


def check_overlay_resolution(base_qc: dict, overlay_qc: dict, names: list[str]) -> None:
    for name in names:
        got, config = resolve(overlay_qc, name)
        if is_mtp_expert(name):
            assert got == (4, 128, "group", True, "pack-quantized"), name
            scheme = config.get_scheme_dict(None, layer_name=name)
            # The predicates vLLM's FusedMoE method selection applies.
            assert config._is_wNa16_group_channel(scheme["weights"], scheme["input_activations"])
            assert scheme["weights"].num_bits in WNA16_SUPPORTED_BITS
            assert scheme["weights"].actorder is None
        elif name.startswith("mtp."):
            assert got is None, f"{name} must stay unquantized, resolved to {got}"
        else:
            assert got == resolve(base_qc, name)[0], name


def test_demo_overlay_config(demo_snapshot, demo_overlay):
    base = json.loads((demo_snapshot / "config.json").read_text())["quantization_config"]
    overlay = json.loads((demo_overlay / "config.json").read_text())["quantization_config"]
    index = json.loads((demo_overlay / "model.safetensors.index.json").read_text())
    names = module_names(index["weight_map"]) + module_names(
        json.loads((demo_snapshot / "model.safetensors.index.json").read_text())["weight_map"])
    check_overlay_resolution(base, overlay, sorted(set(names)))
    # The base config itself kept the MTP experts BF16 even though a generic target matches them.
    assert resolve(base, f"mtp.layers.{DRAFT_LAYER}.mlp.experts.0.gate_proj")[0] is None
    assert resolve(base, "model.language_model.layers.0.mlp.experts.0.gate_proj")[0][0] == 4


MTP_EXACT = [f"mtp.layers.0.mlp.experts.{e}.{p}_proj" for e in range(8) for p in ("gate", "up", "down")]


@pytest.mark.parametrize("ignore_mtp", [
    ["re:^mtp\\..*"],
    ["re:.*mtp.*"],
    ["mtp.fc_embedding", "mtp.layers.0.self_attn.q_proj", *MTP_EXACT],
    [],
], ids=["regex-anchored", "regex-contains", "exact-names", "none"])
def test_any_base_ignore_style(demo_snapshot, ignore_mtp):
    base = demo_quantization_config()
    base["ignore"] = [e for e in base["ignore"] if "mtp" not in e] + ignore_mtp
    overlay = with_mtp_experts_quantized(base, 4, 128, [0, DRAFT_LAYER])
    index = json.loads((demo_snapshot / "model.safetensors.index.json").read_text())
    check_overlay_resolution(base, overlay, module_names(index["weight_map"]))
