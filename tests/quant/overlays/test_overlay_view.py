"""overlay verify / apply: mismatches, views, stacking, the Hugging Face cache layout, vLLM's loader."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from flashnext.errors import FlashnextError
from flashnext.quant.overlays.mtp_int4 import make_mtp_int4
from flashnext.quant.overlays.manifest import OverlayManifest
from flashnext.quant.overlays.view import apply_overlays, verify_overlay
from flashnext.quant.checkpoint.snapshot import Snapshot
from flashnext.tools.cli import main as cli
from support.shards import rewrite_shard, write_shard

MTP_SHARD = "model-00005-of-00005.safetensors"
OTHER_SHARD = "model-00002-of-00005.safetensors"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_verify_ok(demo_snapshot, demo_overlay):
    result = run("overlay", "verify", demo_overlay, "--base", demo_snapshot, "--full")
    assert result.exit_code == 0 and "ok:" in result.output


def test_base_header_change_is_found_by_default(snapshot_copy, demo_overlay):
    def edit(t):
        t["mtp.pre_fc_norm_embedding.weight"] = t["mtp.pre_fc_norm_embedding.weight"][:-1].clone()

    rewrite_shard(snapshot_copy / MTP_SHARD, edit)
    result = run("overlay", "verify", demo_overlay, "--base", snapshot_copy)
    assert result.exit_code == 3
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mismatch: {MTP_SHARD}: base file")


def test_base_content_change_needs_full(snapshot_copy, demo_overlay):
    path = snapshot_copy / MTP_SHARD
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a tensor byte: the header is unchanged
    path.write_bytes(bytes(data))
    assert run("overlay", "verify", demo_overlay, "--base", snapshot_copy).exit_code == 0
    result = run("overlay", "verify", demo_overlay, "--base", snapshot_copy, "--full", "--json")
    assert result.exit_code == 3
    mismatches = json.loads(result.stdout)["mismatches"]
    assert [m["path"] for m in mismatches] == [MTP_SHARD] and "sha256" in mismatches[0]["problem"]


def test_tampered_overlay_and_missing_base_file(snapshot_copy, demo_overlay, tmp_path):
    overlay = tmp_path / "ov"
    shutil.copytree(demo_overlay, overlay)
    with open(overlay / "config.json", "a") as f:
        f.write(" ")
    (snapshot_copy / "model.safetensors.index.json").unlink()
    problems = verify_overlay(snapshot_copy, overlay)
    assert sorted(str(p).split(":")[0] for p in problems) == ["model.safetensors.index.json", "ov/config.json"]
    assert run("overlay", "apply", overlay, "--base", snapshot_copy, "--out", tmp_path / "view").exit_code != 0
    assert not (tmp_path / "view").exists()


def test_apply_one_overlay_and_vllm_reads_the_view(demo_snapshot, demo_overlay, tmp_path):
    view = tmp_path / "view"
    result = run("overlay", "apply", demo_overlay, "--base", demo_snapshot, "--out", view, "--json")
    assert result.exit_code == 0, result.output
    for entry in view.iterdir():
        if entry.name not in (".flashnext-view.json", ".flashnext-output.json"):
            assert entry.is_symlink(), entry
    assert os.readlink(view / MTP_SHARD) == str(demo_overlay / MTP_SHARD)
    assert os.readlink(view / OTHER_SHARD) == str(demo_snapshot / OTHER_SHARD)
    assert run("overlay", "verify", view).exit_code == 0

    weight_utils = pytest.importorskip("vllm.model_executor.model_loader.weight_utils",
                                       reason="vLLM 0.34.0 is installed by .ci/run")
    files = sorted(str(p) for p in view.glob("*.safetensors"))
    files = weight_utils.filter_duplicate_safetensors_files(files, str(view), "model.safetensors.index.json")
    names = {name: t for name, t in weight_utils.safetensors_weights_iterator(files, False)}
    index = json.loads((view / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(names) == set(index)
    assert "mtp.layers.0.mlp.experts.gate_up_proj" not in names
    assert names["mtp.layers.0.mlp.experts.7.down_proj.weight_packed"].dtype == torch.int32


def test_hf_cache_layout(demo_snapshot, tmp_path):
    """Base files are symlinks into blobs/, as huggingface_hub lays a cache snapshot out."""
    repo = tmp_path / "hub" / "models--flashnext--demo"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in demo_snapshot.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    assert Snapshot.open(snap).origin.repo_id == "flashnext/demo"
    overlay = tmp_path / "ov"
    make_mtp_int4(snap, overlay, progress=False)
    manifest = json.loads((overlay / "overlay.json").read_text())
    assert manifest["base"] == {"repo_id": "flashnext/demo", "revision": rev}
    view = tmp_path / "view"
    assert run("overlay", "apply", overlay, "--base", snap, "--out", view).exit_code == 0
    assert (view / OTHER_SHARD).resolve() == (snap / OTHER_SHARD).resolve()
    assert (view / OTHER_SHARD).read_bytes() == (demo_snapshot / OTHER_SHARD).read_bytes()
    assert run("overlay", "verify", view, "--full").exit_code == 0


def _second_overlay(base: Path, out: Path, config_change: dict, shard: str = OTHER_SHARD) -> Path:
    """An overlay of another kind: rewrites one shard's tensor values and sets config keys."""
    out.mkdir()
    tensors = {k: v.clone() for k, v in load_file(base / shard).items()}
    name = next(k for k in tensors if k.endswith("norm.weight"))
    tensors[name] = tensors[name] * 2
    write_shard(out / shard, tensors)
    config = json.loads((base / "config.json").read_text())
    config.update(config_change)
    (out / "config.json").write_text(json.dumps(config))
    manifest = OverlayManifest.new("test-rescale", "test", Snapshot.open(base).origin)
    manifest.replace(out, shard, base / shard)
    manifest.replace(out, "config.json", base / "config.json")
    manifest.write(out)
    return out


def test_stacking_merges_config_and_index(demo_snapshot, demo_overlay, tmp_path):
    second = _second_overlay(demo_snapshot, tmp_path / "ov2", {"flashnext_test": 1})
    view = tmp_path / "view"
    result = apply_overlays(demo_snapshot, [demo_overlay, second], view)
    assert result["replaced_files"] == sorted([MTP_SHARD, OTHER_SHARD])
    config = json.loads((view / "config.json").read_text())
    mtp_config = json.loads((demo_overlay / "config.json").read_text())
    assert config["flashnext_test"] == 1
    assert config["quantization_config"] == mtp_config["quantization_config"]
    index = json.loads((view / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((demo_overlay / "model.safetensors.index.json").read_text())["weight_map"]
    assert os.readlink(view / OTHER_SHARD) == str(second / OTHER_SHARD)
    assert run("overlay", "verify", view).exit_code == 0


def test_stacking_conflicts_are_refused(demo_snapshot, demo_overlay, tmp_path):
    same_shard = _second_overlay(demo_snapshot, tmp_path / "a", {}, shard=MTP_SHARD)
    with pytest.raises(FlashnextError, match=f"both replace {MTP_SHARD}"):
        apply_overlays(demo_snapshot, [demo_overlay, same_shard], tmp_path / "v1")
    clash = _second_overlay(demo_snapshot, tmp_path / "b", {"quantization_config": {"quant_method": "other"}})
    with pytest.raises(FlashnextError, match="both change config.json value"):
        apply_overlays(demo_snapshot, [demo_overlay, clash], tmp_path / "v2")
    assert not (tmp_path / "v1").exists() and not (tmp_path / "v2").exists()


def test_verify_without_base_needs_a_view(demo_overlay):
    result = run("overlay", "verify", demo_overlay)
    assert result.exit_code == 1 and "--base" in result.output
