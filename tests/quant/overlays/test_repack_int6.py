"""INT6 bit-plane layout and repack-int6: exact round trips, INT8 widening, and vLLM's view of them."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32 as ct_pack
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from flashnext.quant.formats.bitplane import bitplane_to_codes, codes_to_bitplane, dense6_to_bitplane
from flashnext.quant.formats.ct_config import DEFAULT_INT6_TARGETS
from flashnext.errors import FlashnextError
from flashnext.quant.formats.packing import pack_int32, packed_words, unpack_int32
from flashnext.quant.overlays.int6_repack import repack_int6
from flashnext.tools.cli import main as cli
from support.shards import rewrite_shard

SHARED = "model.language_model.layers.0.mlp.shared_expert.gate_proj"


def test_every_value_at_every_position():
    rows = []
    for v in range(-32, 32):
        for p in range(32):
            row = torch.full((32,), 5, dtype=torch.int8)
            row[p] = v
            rows.append(row)
    codes = torch.stack(rows)
    planes = codes_to_bitplane(codes)
    assert planes.shape == (64 * 32, 24) and planes.dtype == torch.uint8
    assert torch.equal(bitplane_to_codes(planes, 32), codes)
    # the documented byte layout, for one row
    u = (codes[37].to(torch.int16) + 32).tolist()
    lo = [(u[2 * j] & 15) | ((u[2 * j + 1] & 15) << 4) for j in range(16)]
    hi = [sum(((u[4 * j + i] >> 4) & 3) << (2 * i) for i in range(4)) for j in range(8)]
    assert planes[37].tolist() == lo + hi


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 5), blocks=st.integers(1, 8), seed=st.integers(0, 2**31))
def test_round_trip_through_the_dense_layout(rows, blocks, seed):
    cols = 16 * blocks
    codes = torch.randint(-32, 32, (rows, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    dense = pack_int32(codes, 6)
    planes = dense6_to_bitplane(dense, cols)
    assert planes.numel() == dense.numel() * 4  # the same bytes
    assert torch.equal(pack_int32(bitplane_to_codes(planes, cols), 6), dense)


@pytest.mark.parametrize("cols", [8, 40, 100])
def test_k_that_would_change_the_byte_count_is_refused(cols):
    with pytest.raises(FlashnextError, match="multiple of 16"):
        codes_to_bitplane(torch.zeros(2, cols, dtype=torch.int8))
    # the dense layout itself handles any K
    codes = torch.randint(-32, 32, (2, cols), dtype=torch.int8)
    assert torch.equal(unpack_int32(pack_int32(codes, 6), 6, cols), codes)


def test_overlay_reverse_is_byte_identical(demo_snapshot, tmp_path):
    ov, view, back = tmp_path / "bp", tmp_path / "view", tmp_path / "back"
    report = repack_int6(demo_snapshot, ov)
    assert len(report["modules"]) == 12 and all("shared_expert" in m for m in report["modules"])
    assert report["bytes_before"] == report["bytes_after"]
    config = json.loads((ov / "config.json").read_text())
    assert config["flashnext"]["int6_bitplane"]["layout"] == "flashnext.bitplane6/1"
    shard = load_file(ov / report["shards"][0])
    assert shard[f"{SHARED}.weight_packed"].dtype == torch.uint8
    assert not (ov / "model.safetensors.index.json").exists()  # names and sizes unchanged
    assert CliRunner().invoke(cli, ["overlay", "apply", str(ov), "--base", str(demo_snapshot), "--out", str(view)]).exit_code == 0
    result = CliRunner().invoke(cli, ["repack-int6", "--src", str(view), "--out", str(back), "--reverse"])
    assert result.exit_code == 0, result.output
    for name in report["shards"] + ["config.json"]:
        assert (back / name).read_bytes() == (demo_snapshot / name).read_bytes(), name


def test_widening_to_int8_is_lossless_and_resolves_to_8_bits(demo_snapshot, tmp_path):
    ov = tmp_path / "i8"
    report = repack_int6(demo_snapshot, ov, mode="int8")
    assert report["bytes_after"] > report["bytes_before"]
    src = load_file(demo_snapshot / "model-00001-of-00005.safetensors")
    out = load_file(ov / "model-00001-of-00005.safetensors")
    n, k = src[f"{SHARED}.weight_shape"].tolist()
    assert out[f"{SHARED}.weight_packed"].shape == (n, packed_words(k, 8))
    assert torch.equal(unpack_int32(out[f"{SHARED}.weight_packed"], 8, k),
                       unpack_int32(src[f"{SHARED}.weight_packed"], 6, k))
    assert torch.equal(out[f"{SHARED}.weight_scale"], src[f"{SHARED}.weight_scale"])
    index = json.loads((ov / "model.safetensors.index.json").read_text())
    base_index = json.loads((demo_snapshot / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == base_index["weight_map"]
    # total_size counts tensor bytes, not headers: the base's plus what widening added.
    shapes = []
    for shard in report["shards"]:
        tensors = load_file(demo_snapshot / shard)
        shapes += [tensors[f"{m}.weight_shape"].tolist() for m in report["modules"] if f"{m}.weight_shape" in tensors]
    assert len(shapes) == len(report["modules"])
    widened = sum(rows * (packed_words(cols, 8) - packed_words(cols, 6)) * 4 for rows, cols in shapes)
    assert index["metadata"]["total_size"] == base_index["metadata"]["total_size"] + widened

    ct = pytest.importorskip("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
                             reason="vLLM 0.33.0 is installed by .ci/run")
    base_qc = json.loads((demo_snapshot / "config.json").read_text())["quantization_config"]
    new_qc = json.loads((ov / "config.json").read_text())["quantization_config"]
    new, old = ct.CompressedTensorsConfig.from_config(new_qc), ct.CompressedTensorsConfig.from_config(base_qc)
    for module in report["modules"]:
        w = new.get_scheme_dict(None, layer_name=module)["weights"]
        assert (w.num_bits, w.group_size) == (8, 64)
    for module in ("model.language_model.layers.0.linear_attn.in_proj_qkv", "lm_head",
                   "model.language_model.layers.0.mlp.experts.0.up_proj"):
        assert new.get_scheme_dict(None, layer_name=module) == old.get_scheme_dict(None, layer_name=module)


def test_padded_017_layout_is_refused(snapshot_copy, tmp_path):
    def edit(tensors):
        n, k = tensors[f"{SHARED}.weight_shape"].tolist()
        codes = unpack_int32(tensors[f"{SHARED}.weight_packed"], 6, k)
        tensors[f"{SHARED}.weight_packed"] = ct_pack(codes, 6)  # compressed-tensors 0.17: 5 values per word

    rewrite_shard(snapshot_copy / "model-00001-of-00005.safetensors", edit)
    with pytest.raises(FlashnextError, match="padded 6-bit layout"):
        repack_int6(snapshot_copy, tmp_path / "ov")
    assert not (tmp_path / "ov").exists()


def test_bad_targets(demo_snapshot, tmp_path):
    result = CliRunner().invoke(cli, ["repack-int6", "--src", str(demo_snapshot), "--out", str(tmp_path / "o"),
                                      "--targets", "nothing_matches$"])
    assert result.exit_code == 1 and "no module matches" in result.output
    result = CliRunner().invoke(cli, ["repack-int6", "--src", str(demo_snapshot), "--out", str(tmp_path / "o"),
                                      "--targets", "("])
    assert result.exit_code == 1 and "regular expression" in result.output
    assert not (tmp_path / "o").exists()


ATTENTION = "model.language_model.layers.0.linear_attn.in_proj_qkv"
REACHES_ATTENTION = r".*layers\.0\.(mlp\.shared_expert\.gate_proj|linear_attn\.in_proj_qkv)$"


def test_bit_planes_outside_the_shared_experts_are_refused_in_one_line(demo_snapshot, tmp_path):
    out = tmp_path / "o"
    argv = ["repack-int6", "--src", str(demo_snapshot), "--out", str(out), "--targets", REACHES_ATTENTION]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 1, result.output
    message = result.output.strip()
    assert "\n" not in message and ATTENTION in message and "--force-slower" in message
    assert "Humming" in message and "12.7 us" in message  # the measured slowdown, not a bare no
    assert SHARED not in message  # the shared expert in the same list is where planes are faster
    assert not out.exists()

    result = CliRunner().invoke(cli, argv + ["--force-slower", "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.output)["modules"]) == {SHARED, ATTENTION}


def test_the_refusal_is_about_bit_planes_only(demo_snapshot, tmp_path):
    # widening to INT8 serves through stock vLLM's own 8-bit kernel: no bit-plane slowdown to refuse
    report = repack_int6(demo_snapshot, tmp_path / "i8", REACHES_ATTENTION, "int8")
    assert set(report["modules"]) == {SHARED, ATTENTION}
    with pytest.raises(FlashnextError, match="force_slower repacks them anyway") as refused:
        repack_int6(demo_snapshot, tmp_path / "bp", REACHES_ATTENTION)
    assert refused.value.field == "force_slower"


def test_the_refusal_agrees_with_what_the_default_repacks(demo_snapshot):
    from flashnext.quant.checkpoint.snapshot import Snapshot
    from flashnext.quant.overlays.int6_repack import find_targets, slower_modules

    snap = Snapshot.open(demo_snapshot)
    default = [t.module for t in find_targets(snap, DEFAULT_INT6_TARGETS, "bitplane")]
    projections = r".*\.(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|self_attn\.[qkvo]_proj)$"
    attention = [t.module for t in find_targets(snap, projections, "bitplane")]
    assert default and attention
    assert slower_modules(default) == []  # the default repack is never refused
    assert slower_modules(attention) == attention  # the INT6 attention projections always are


LOADER_PROBE = textwrap.dedent('''
    import math, sys, tempfile, torch
    from fractions import Fraction
    from safetensors.torch import load_file
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.parameter import PackedvLLMParameter
    shard, module = sys.argv[1], sys.argv[2]
    tensors = load_file(shard)
    n, k = tensors[module + ".weight_shape"].tolist()
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="file://" + tempfile.mktemp())
        initialize_model_parallel(1, 1)
        # the parameter CompressedTensorsWNA16.create_weights makes for a 6-bit module
        param = PackedvLLMParameter(input_dim=1, output_dim=0, weight_loader=None, packed_factor=Fraction(32, 6),
                                    packed_dim=1, data=torch.empty(n, math.ceil(k * 6 / 32), dtype=torch.int32))
        try:
            param.load_column_parallel_weight(tensors[module + ".weight_packed"])
        except AssertionError:
            print("REFUSED")
        else:
            print("LOADED")
''')


def test_unpatched_vllm_loader_refuses_the_bitplane_tensor(demo_snapshot, tmp_path):
    pytest.importorskip("vllm.model_executor.parameter", reason="vLLM 0.33.0 is installed by .ci/run")
    ov = tmp_path / "bp"
    repack_int6(demo_snapshot, ov)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    def probe(shard):
        out = subprocess.run([sys.executable, "-c", LOADER_PROBE, str(shard), SHARED], capture_output=True,
                             text=True, env=env, timeout=300)
        return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert probe(demo_snapshot / "model-00001-of-00005.safetensors") == "LOADED"
    assert probe(ov / "model-00001-of-00005.safetensors") == "REFUSED"
