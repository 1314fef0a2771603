"""vLLM 0.34.0 itself, imported on the CPU, resolves every module of the overlay's config."""

import copy
import json
import re

import pytest

from flashnext.quant.formats.ct_config import with_mtp_experts_quantized
from flashnext.quant.demo import DEMO_TEXT_CONFIG, demo_quantization_config

vllm_ct = pytest.importorskip(
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    reason="vLLM 0.34.0 is installed by .ci/run")
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


@pytest.fixture(scope="module")
def three_overlays(demo_snapshot, tmp_path_factory):
    """Three overlays of different kinds over disjoint shards: the MTP experts at INT4 g32 (so that
    they differ from the base's generic g128 expert group), layers 0-1's shared experts widened to
    INT8 (a group of their own, put first), layers 2-3's in the bit-plane layout."""
    from flashnext.quant.overlays.mtp_int4 import MtpInt4Options, make_mtp_int4
    from flashnext.quant.overlays.int6_repack import repack_int6

    root = tmp_path_factory.mktemp("stack")
    make_mtp_int4(demo_snapshot, root / "mtp", MtpInt4Options(group_size=32), progress=False)
    repack_int6(demo_snapshot, root / "int8", r".*layers\.[01]\.mlp\.shared_expert\.(gate|up|down)_proj$", "int8")
    repack_int6(demo_snapshot, root / "bitplane", r".*layers\.[23]\.mlp\.shared_expert\.(gate|up|down)_proj$",
                "bitplane")
    return {name: root / name for name in ("mtp", "int8", "bitplane")}


def _qc(path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("stack", [("mtp", "int8"), ("int8", "mtp"), ("mtp", "int8", "bitplane"),
                                   ("bitplane", "int8", "mtp")], ids="+".join)
def test_stacked_views_resolve_as_each_overlay_intended(demo_snapshot, three_overlays, stack, tmp_path):
    from flashnext.quant.overlays.view import apply_overlays

    overlays = [three_overlays[name] for name in stack]
    view = tmp_path / "view"
    apply_overlays(demo_snapshot, overlays, view)
    merged = json.loads((view / "config.json").read_text())
    index = json.loads((view / "model.safetensors.index.json").read_text())
    names = sorted(set(module_names(index["weight_map"]))
                   | set(module_names(json.loads((demo_snapshot / "model.safetensors.index.json").read_text())
                                      ["weight_map"])))
    base_qc = _qc(demo_snapshot)
    checked = {name: 0 for name in stack}
    for name in names:
        want = resolve(base_qc, name)[0]
        for overlay_name, overlay in zip(stack, overlays):
            intended = resolve(_qc(overlay), name)[0]
            if intended != resolve(base_qc, name)[0]:
                want = intended
                checked[overlay_name] += 1
        assert resolve(merged["quantization_config"], name)[0] == want, name
    # Each overlay that changes resolution changed some modules, and the view carries the change.
    assert checked.get("mtp", 1) > 0 and checked.get("int8", 1) > 0
    assert resolve(merged["quantization_config"], f"mtp.layers.{DRAFT_LAYER}.mlp.experts.0.gate_proj")[0][:2] == (4, 32)
    assert resolve(merged["quantization_config"], "model.language_model.layers.0.mlp.shared_expert.up_proj")[0][:2] \
        == (8, 64)
    assert resolve(merged["quantization_config"], "model.language_model.layers.2.mlp.shared_expert.up_proj")[0][:2] \
        == (6, 64)
    if "bitplane" in stack:
        assert len(merged["flashnext"]["int6_bitplane"]["modules"]) == 6
