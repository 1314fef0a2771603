"""Every module of the demo checkpoint, plain, with each overlay and with stacks of them, resolves to
the same scheme through the builders' rule (``ct_config.scheme_for`` on checkpoint names), the
hooks' rule (``ct_config.vllm_scheme`` and the bit-plane record on vLLM's names) and vLLM 0.34.0's own
``CompressedTensorsConfig``, built from the view's config and mapped with the model's own mapper."""

import json

import pytest

from flashnext.errors import FlashnextError
from flashnext.quant.formats.bitplane import BitplaneRecord
from flashnext.quant.formats.ct_config import (quantization_config_of, scheme_for, shard_names, vllm_module_name,
                                               vllm_scheme, weight_args)

vllm_ct = pytest.importorskip(
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    reason="vLLM 0.34.0 is installed by .ci/run")

from test_vllm_resolution import module_names  # noqa: E402


@pytest.fixture(scope="module")
def model_cls():
    from vllm.model_executor.models import ModelRegistry

    from flashnext.quant.demo import demo_config

    return ModelRegistry._try_load_model_cls(demo_config()["architectures"][0])


def vllm_config_of(qc: dict, model_cls):
    """vLLM's own config for ``qc``, mapped and given the fused names as vLLM's model loader does."""
    from vllm.model_executor.model_loader.utils import configure_quant_config

    config = vllm_ct.CompressedTensorsConfig.from_config(json.loads(json.dumps(qc)))
    configure_quant_config(config, model_cls)
    return config


def described(scheme) -> tuple | None:
    w = weight_args(scheme)
    return None if w is None else (w.num_bits, w.group_size, str(w.strategy), w.symmetric, str(w.type))


def three_ways(config: dict, names: list[str], model_cls) -> dict:
    """name -> (builder's, hooks', vLLM's) resolution, with the bit-plane verdicts."""
    from flashnext.serving.hooks.int6_bitplane import bitplane_parts

    qc = quantization_config_of(config)
    mapper = model_cls.hf_to_vllm_mapper.get_rename_mapper()
    ours, theirs = vllm_config_of(qc, model_cls), vllm_config_of(qc, model_cls)
    record = BitplaneRecord.from_config(config)
    listed = set(record.modules) if record else set()
    fused = ours.packed_modules_mapping
    out = {}
    for name in names:
        vname = vllm_module_name(name, mapper)
        out[name] = (described(scheme_for(qc, name)), described(vllm_scheme(ours, vname, mapper)),
                     described(theirs.get_scheme_dict(None, layer_name=vname)),
                     name in listed, bitplane_parts(vname, fused, listed, mapper))
    return out


def check_agreement(config: dict, names: list[str], model_cls, vllm_differs: dict | None = None) -> None:
    vllm_differs = vllm_differs or {}
    for name, (builder, hooks, vllm, recorded, bitplane) in three_ways(config, names, model_cls).items():
        assert builder == hooks, (name, builder, hooks)
        assert (vllm_differs.get(name, builder)) == vllm, (name, builder, vllm)
        assert recorded == bitplane, name
        if bitplane:
            assert builder[:2] == (6, 64), name


def lm_head_gap(names):
    """vLLM 0.34.0's ``apply_vllm_mapper`` maps only targets with a dot, so the release's
    ``lm_head`` target stays a checkpoint name and vLLM's own config leaves ``language_model.lm_head``
    unquantized; the hooks finish the mapping (``ct_config.vllm_entries``)."""
    return {n: None for n in names if n == "lm_head"}


def config_of(path) -> dict:
    return json.loads((path / "config.json").read_text())


def names_of(*paths) -> list[str]:
    names = set()
    for path in paths:
        index = path / "model.safetensors.index.json"
        if index.exists():
            names |= set(module_names(json.loads(index.read_text())["weight_map"]))
    return sorted(names)


@pytest.fixture(scope="module")
def overlays(demo_snapshot, demo_overlay, tmp_path_factory):
    from flashnext.quant.overlays.int6_repack import repack_int6

    root = tmp_path_factory.mktemp("agreement")
    repack_int6(demo_snapshot, root / "bitplane")
    repack_int6(demo_snapshot, root / "int8", r".*layers\.[01]\.mlp\.shared_expert\.(gate|up|down)_proj$", "int8")
    repack_int6(demo_snapshot, root / "bitplane23", r".*layers\.[23]\.mlp\.shared_expert\.(gate|up|down)_proj$")
    return {"mtp": demo_overlay, "bitplane": root / "bitplane", "int8": root / "int8",
            "bitplane23": root / "bitplane23"}


def test_the_plain_checkpoint(demo_snapshot, model_cls):
    names = names_of(demo_snapshot)
    check_agreement(config_of(demo_snapshot), names, model_cls, lm_head_gap(names))
    resolved = three_ways(config_of(demo_snapshot), ["lm_head", "model.language_model.embed_tokens"], model_cls)
    assert resolved["lm_head"][1] == resolved["model.language_model.embed_tokens"][1] == \
        (8, 128, "group", True, "int")


@pytest.mark.parametrize("stack", [("mtp",), ("bitplane",), ("int8",), ("mtp", "int8"), ("int8", "bitplane23"),
                                   ("mtp", "int8", "bitplane23"), ("bitplane23", "int8", "mtp")], ids="+".join)
def test_views(demo_snapshot, overlays, model_cls, stack, tmp_path):
    from flashnext.quant.overlays.view import apply_overlays

    view = tmp_path / "view"
    apply_overlays(demo_snapshot, [overlays[s] for s in stack], view)
    names = names_of(demo_snapshot, view)
    check_agreement(config_of(view), names, model_cls, lm_head_gap(names))


def test_fused_layers_resolve_through_their_shards(demo_snapshot, overlays, model_cls, tmp_path):
    """vLLM's merged layers: the hooks and vLLM agree, and with the builders' verdict on the shards."""
    from flashnext.quant.overlays.view import apply_overlays

    view = tmp_path / "view"
    apply_overlays(demo_snapshot, [overlays["int8"], overlays["bitplane23"]], view)
    config = config_of(view)
    qc = quantization_config_of(config)
    mapper = model_cls.hf_to_vllm_mapper.get_rename_mapper()
    ours, theirs = vllm_config_of(qc, model_cls), vllm_config_of(qc, model_cls)
    names = set(names_of(demo_snapshot))
    checked = mixed = 0
    for name in sorted(names):
        for fused, shards in ours.packed_modules_mapping.items():
            stem, _, last = name.rpartition(".")
            if last != shards[0]:
                continue
            parts = [f"{stem}.{s}" for s in shards]
            if not all(p in names for p in parts):
                continue
            vname = vllm_module_name(f"{stem}.{fused}", mapper)
            assert shard_names(vname, ours.packed_modules_mapping) == [vllm_module_name(p, mapper) for p in parts]
            builder = [described(scheme_for(qc, p)) for p in parts]
            vllm = described(theirs.get_scheme_dict(None, layer_name=vname))
            if len(set(builder)) > 1:
                # A merged layer whose shards differ: vLLM gives it the first shard's scheme;
                # flashnext's rule refuses to pick one.
                assert vllm == builder[0], vname
                with pytest.raises(FlashnextError, match="different schemes"):
                    vllm_scheme(ours, vname, mapper)
                mixed += 1
                continue
            assert described(vllm_scheme(ours, vname, mapper)) == vllm == builder[0], vname
            checked += 1
    # vLLM 0.34.0 lists only q/k/v under qkv_proj (0.33.0 listed the indexer's INT8 index_qk_proj
    # too, beside q/k/v's INT6; Qwen4ExpQSAAttention now fuses it only when its quant method is
    # q/k/v's): no merged layer of the demo mixes schemes any more.
    assert checked > 10 and mixed == 0
    # The rule still refuses one that does: QSA's qkv_proj under 0.33.0's mapping.
    qkv = next(n for n in sorted(names) if n.endswith(".self_attn.q_proj")).removesuffix("q_proj") + "qkv_proj"
    ours.packed_modules_mapping = {**ours.packed_modules_mapping,
                                   "qkv_proj": ["q_proj", "k_proj", "v_proj", "indexer.index_qk_proj"]}
    with pytest.raises(FlashnextError, match="different schemes"):
        vllm_scheme(ours, vllm_module_name(qkv, mapper), mapper)


def test_the_reverse_overlay_over_bit_planes(demo_snapshot, overlays, model_cls, tmp_path):
    """``repack-int6 --reverse`` over a view with bit planes (its base): the view of it resolves as the
    plain checkpoint does, with no module left listed as bit planes."""
    from flashnext.quant.overlays.int6_repack import repack_int6
    from flashnext.quant.overlays.view import apply_overlays

    planes = tmp_path / "planes"
    apply_overlays(demo_snapshot, [overlays["bitplane"]], planes)
    repack_int6(planes, tmp_path / "dense", mode="reverse")
    view = tmp_path / "view"
    apply_overlays(planes, [tmp_path / "dense"], view)
    names = names_of(demo_snapshot, view)
    check_agreement(config_of(view), names, model_cls, lm_head_gap(names))
    assert BitplaneRecord.from_config(config_of(view)) is None or not BitplaneRecord.from_config(config_of(view)).modules
    plain = three_ways(config_of(demo_snapshot), names, model_cls)
    assert three_ways(config_of(view), names, model_cls) == plain
