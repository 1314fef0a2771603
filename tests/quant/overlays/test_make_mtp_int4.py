"""make-mtp-int4 end to end on the demo checkpoint, and every bad input."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationScheme
from safetensors.torch import load_file

from flashnext.quant.checkpoint import fsutil
from flashnext.quant.demo import DEMO_TEXT_CONFIG
from flashnext.errors import FlashnextError
from flashnext.quant.quantizers.mse_rtn import dequantize, quantize_mse_rtn
from flashnext.quant.overlays.mtp_int4 import MtpInt4Options, make_mtp_int4
from flashnext.quant.formats.packing import unpack_int32
from flashnext.quant.formats.safetensors_io import read_header
from flashnext.tools.cli import main as flashnext_cli
from flashnext.tools.make_mtp_int4 import main as make_mtp_int4_cli
from support.shards import rewrite_shard, write_shard

E = DEMO_TEXT_CONFIG["num_experts"]
H = DEMO_TEXT_CONFIG["hidden_size"]
I = DEMO_TEXT_CONFIG["moe_intermediate_size"]
MTP_SHARD = "model-00005-of-00005.safetensors"
EXPERTS = "mtp.layers.0.mlp.experts"


def tree_digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if name in p.name]


# --- the overlay ---------------------------------------------------------------------------

def test_overlay_holds_exactly_the_mounted_files(demo_overlay):
    assert sorted(p.name for p in demo_overlay.iterdir()) == sorted(
        [MTP_SHARD, "model.safetensors.index.json", "config.json", "overlay.json", ".flashnext-output.json"])


def test_source_snapshot_is_untouched(snapshot_copy, tmp_path):
    before = tree_digest(snapshot_copy)
    make_mtp_int4(snapshot_copy, tmp_path / "ov", progress=False)
    assert tree_digest(snapshot_copy) == before


def test_index_changes_only_the_mtp_expert_entries(demo_snapshot, demo_overlay):
    base = json.loads((demo_snapshot / "model.safetensors.index.json").read_text())["weight_map"]
    new = json.loads((demo_overlay / "model.safetensors.index.json").read_text())["weight_map"]
    fused = {f"{EXPERTS}.gate_up_proj", f"{EXPERTS}.down_proj"}
    assert {k: v for k, v in base.items() if k not in fused} == {
        k: v for k, v in new.items() if not k.startswith(EXPERTS + ".")}
    added = {k for k in new if k.startswith(EXPERTS + ".")}
    assert added == {f"{EXPERTS}.{e}.{p}_proj.{s}" for e in range(E) for p in ("gate", "up", "down")
                     for s in ("weight_packed", "weight_scale", "weight_shape")}
    assert all(new[k] == MTP_SHARD for k in added)
    # Entries stay where the fused ones were, in order.
    order = list(new)
    assert order.index(f"{EXPERTS}.0.gate_proj.weight_packed") == list(base).index(min(fused, key=list(base).index))


def test_config_changes_only_quantization_config(demo_snapshot, demo_overlay):
    base = json.loads((demo_snapshot / "config.json").read_text())
    new = json.loads((demo_overlay / "config.json").read_text())
    base.pop("quantization_config")
    new.pop("quantization_config")
    assert base == new


def test_other_tensors_of_the_replaced_shard_are_byte_identical(demo_snapshot, demo_overlay):
    old = read_header(demo_snapshot / MTP_SHARD)
    new = read_header(demo_overlay / MTP_SHARD)
    with open(demo_snapshot / MTP_SHARD, "rb") as a, open(demo_overlay / MTP_SHARD, "rb") as b:
        for name, entry in old.entries.items():
            if name.startswith(EXPERTS + ".") and "proj" in name and name.count(".") == 5:
                continue
            if name in (f"{EXPERTS}.gate_up_proj", f"{EXPERTS}.down_proj"):
                assert name not in new.entries
                continue
            n = new.entries[name]
            assert (n.dtype, n.shape) == (entry.dtype, entry.shape)
            a.seek(entry.begin)
            b.seek(n.begin)
            assert a.read(entry.nbytes) == b.read(n.nbytes), name
    assert new.metadata == old.metadata


def test_manifest_hashes(demo_snapshot, demo_overlay):
    manifest = json.loads((demo_overlay / "overlay.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["kind"] == "mtp-int4"
    assert manifest["builder"]["name"] == "make-mtp-int4"
    files = {r["path"]: r for r in manifest["replaces"]}
    assert set(files) == {MTP_SHARD, "model.safetensors.index.json", "config.json"}
    for name, rec in files.items():
        assert rec["sha256"] == fsutil.sha256_file(demo_overlay / name)
        assert rec["base_sha256"] == fsutil.sha256_file(demo_snapshot / name)
    report = manifest["report"]
    for proj in ("gate", "up", "down"):
        p = report["projections"][proj]
        assert p["matrices"] == E
        assert p["ratio_to_absmax_rtn"] <= 0.78


def test_tensors_match_our_quantizer_and_compressed_tensors_decompression(demo_snapshot, demo_overlay):
    """Round trip: compressed-tensors' own decompression gives exactly our dequantized values,
    which are the quantization of the BF16 source split the way vLLM splits the fused tensor."""
    src = load_file(demo_snapshot / MTP_SHARD)
    out = load_file(demo_overlay / MTP_SHARD)
    qc = json.loads((demo_overlay / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["flashnext_mtp_routed_experts"]
    scheme = QuantizationScheme(**group)
    gate_up, down = src[f"{EXPERTS}.gate_up_proj"], src[f"{EXPERTS}.down_proj"]
    gate_w, up_w = gate_up.chunk(2, dim=1)  # how vLLM 0.34.0 splits w13
    for e in range(E):
        for proj, w in (("gate", gate_w[e]), ("up", up_w[e]), ("down", down[e])):
            base = f"{EXPERTS}.{e}.{proj}_proj"
            packed, scale, shape = (out[f"{base}.weight_packed"], out[f"{base}.weight_scale"],
                                    out[f"{base}.weight_shape"])
            assert packed.dtype == torch.int32 and scale.dtype == torch.bfloat16
            assert shape.tolist() == list(w.shape)
            codes = unpack_int32(packed, 4, w.shape[1])
            ours = dequantize(codes, scale, 128)
            theirs = PackedQuantizationCompressor.decompress(
                {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}, scheme)["weight"]
            assert torch.equal(theirs, ours), base
            expected = quantize_mse_rtn(w.float(), 4, 128)
            assert torch.equal(codes, expected.codes) and torch.equal(scale, expected.scale)


def test_per_expert_source_layout(snapshot_copy, tmp_path):
    """A snapshot that stores the experts per expert (2-D) gives the same tensors."""
    shard = snapshot_copy / MTP_SHARD
    tensors = {k: v.clone() for k, v in load_file(shard).items()}  # the file is rewritten below
    gate_up = tensors.pop(f"{EXPERTS}.gate_up_proj")
    down = tensors.pop(f"{EXPERTS}.down_proj")
    for e in range(E):
        tensors[f"{EXPERTS}.{e}.gate_proj.weight"] = gate_up[e, :I].clone()
        tensors[f"{EXPERTS}.{e}.up_proj.weight"] = gate_up[e, I:].clone()
        tensors[f"{EXPERTS}.{e}.down_proj.weight"] = down[e].clone()
    write_shard(shard, tensors)
    index_path = snapshot_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wm = {k: v for k, v in index["weight_map"].items() if not k.startswith(EXPERTS + ".")}
    wm.update({k: MTP_SHARD for k in tensors if k.startswith(EXPERTS + ".")})
    index["weight_map"] = wm
    index_path.write_text(json.dumps(index))
    make_mtp_int4(snapshot_copy, tmp_path / "ov", progress=False)
    got = load_file(tmp_path / "ov" / MTP_SHARD)
    assert not any(k.endswith(".weight") and k.startswith(EXPERTS) for k in got)
    q = quantize_mse_rtn(gate_up[3, I:].float(), 4, 128)
    assert torch.equal(got[f"{EXPERTS}.3.up_proj.weight_scale"], q.scale)


@pytest.mark.parametrize("gs", [32, 64])
def test_other_group_sizes_and_positive_scales(demo_snapshot, tmp_path, gs):
    report = make_mtp_int4(demo_snapshot, tmp_path / "ov",
                           MtpInt4Options(group_size=gs, positive_scales=True), progress=False)
    assert all(p["negative_scales"] == 0 for p in report["projections"].values())
    out = load_file(tmp_path / "ov" / MTP_SHARD)
    assert out[f"{EXPERTS}.0.down_proj.weight_scale"].shape == (H, I // gs)
    assert bool((out[f"{EXPERTS}.0.gate_proj.weight_scale"] >= 0).all())
    qc = json.loads((tmp_path / "ov" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["flashnext_mtp_routed_experts"]["weights"]["group_size"] == gs


# --- the command line ------------------------------------------------------------------------

def test_cli_end_to_end_with_report_and_json(demo_snapshot, tmp_path):
    out, report = tmp_path / "ov", tmp_path / "report.json"
    result = CliRunner().invoke(make_mtp_int4_cli, ["--src", str(demo_snapshot), "--out", str(out),
                                                    "--report", str(report), "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == json.loads(report.read_text())
    assert printed["projections"]["down"]["matrices"] == E
    # again without --force: refused, the first overlay untouched
    before = tree_digest(out)
    again = CliRunner().invoke(make_mtp_int4_cli, ["--src", str(demo_snapshot), "--out", str(out)])
    assert again.exit_code != 0 and "--force" in again.output
    assert tree_digest(out) == before
    forced = CliRunner().invoke(make_mtp_int4_cli, ["--src", str(demo_snapshot), "--out", str(out),
                                                    "--force", "--no-progress"])
    assert forced.exit_code == 0, forced.output
    assert leftovers(tmp_path, ".ov.") == []


def test_umbrella_has_every_command():
    for args in (["--help"], ["make-mtp-int4", "--help"], ["demo-checkpoint", "--help"], ["serve", "--help"],
                 ["serve", "down", "--help"], ["serve", "logs", "--help"], ["doctor", "--help"],
                 ["repack-int6", "--help"], ["overlay", "--help"], ["overlay", "verify", "--help"],
                 ["overlay", "apply", "--help"], ["overlay", "upload", "--help"], ["overlay", "fetch", "--help"],
                 ["ple", "--help"], ["ple", "ids", "--help"], ["ple", "layout", "--help"], ["ple", "build", "--help"],
                 ["ple", "verify", "--help"], ["ple", "residency", "--help"], ["ple", "drive-check", "--help"],
                 ["patches", "--help"], ["patches", "list", "--help"], ["patches", "check", "--help"],
                 ["patches", "apply", "--help"]):
        result = CliRunner().invoke(flashnext_cli, args)
        assert result.exit_code == 0, (args, result.output)


# --- bad input: one line, non-zero exit, nothing at --out ---------------------------------------

def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _nan(t):
    t[f"{EXPERTS}.down_proj"][3, 5, 7] = float("nan")


def _inf(t):
    t[f"{EXPERTS}.gate_up_proj"][0, 0, 0] = float("inf")


def _drop_fused(t):
    del t[f"{EXPERTS}.down_proj"]


def _shape_config(c):
    c["text_config"]["moe_intermediate_size"] = 64


def _experts_config(c):
    c["text_config"]["num_experts"] = 16


BREAKAGES = {
    "missing index": (lambda s: (s / "model.safetensors.index.json").unlink(), "model.safetensors.index.json"),
    "missing shard": (lambda s: (s / MTP_SHARD).unlink(), "missing"),
    "missing config": (lambda s: (s / "config.json").unlink(), "config.json"),
    "no MTP tensors": (lambda s: _edit_json(s / "model.safetensors.index.json", lambda i: [
        i["weight_map"].pop(k) for k in list(i["weight_map"]) if k.startswith(EXPERTS)]), "no MTP routed experts"),
    "index names a tensor the shard lacks": (lambda s: rewrite_shard(s / MTP_SHARD, _drop_fused), "missing"),
    "shape disagrees with config": (lambda s: _edit_json(s / "config.json", _shape_config), "config.json implies"),
    "num_experts disagrees": (lambda s: _edit_json(s / "config.json", _experts_config), "config.json implies"),
    "NaN weight": (lambda s: rewrite_shard(s / MTP_SHARD, _nan), "refusing to quantize non-finite weights"),
    "Inf weight": (lambda s: rewrite_shard(s / MTP_SHARD, _inf), "refusing to quantize non-finite weights"),
    "truncated shard": (lambda s: os.truncate(s / MTP_SHARD, 1000), "truncated"),
    "not compressed-tensors": (lambda s: _edit_json(s / "config.json", lambda c: c.pop("quantization_config")),
                               "quantization_config"),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_bad_snapshot(snapshot_copy, tmp_path, breakage):
    breaker, message = BREAKAGES[breakage]
    breaker(snapshot_copy)
    out = tmp_path / "ov"
    result = CliRunner().invoke(make_mtp_int4_cli, ["--src", str(snapshot_copy), "--out", str(out), "--no-progress"])
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "Traceback" not in result.output
    assert not out.exists() and leftovers(tmp_path, ".ov.") == []


def test_k_not_divisible_by_group_size(tmp_path):
    """A head whose intermediate size is not a multiple of the group size is refused."""
    snap = tmp_path / "snap"
    snap.mkdir()
    cfg = {"model_type": "qwen4_exp", "text_config": {"num_experts": 2, "hidden_size": 256,
           "moe_intermediate_size": 96, "num_hidden_layers": 4},
           "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {}, "ignore": []}}
    (snap / "config.json").write_text(json.dumps(cfg))
    tensors = {f"{EXPERTS}.gate_up_proj": torch.zeros(2, 192, 256, dtype=torch.bfloat16),
               f"{EXPERTS}.down_proj": torch.zeros(2, 256, 96, dtype=torch.bfloat16)}
    write_shard(snap / "m.safetensors", tensors)
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "m.safetensors" for k in tensors}}))
    with pytest.raises(FlashnextError, match="K=96 is not divisible by the group size 128"):
        make_mtp_int4(snap, tmp_path / "ov", progress=False)
    assert not (tmp_path / "ov").exists()


def test_already_quantized_experts_are_refused(tmp_path, demo_snapshot, demo_overlay):
    """A snapshot with the overlay applied (per-expert weight_packed) is refused."""
    applied = tmp_path / "applied"
    shutil.copytree(demo_snapshot, applied)
    for f in demo_overlay.iterdir():
        if f.name != "overlay.json":
            shutil.copy(f, applied / f.name)
    with pytest.raises(FlashnextError, match="already quantized"):
        make_mtp_int4(applied, tmp_path / "ov", progress=False)


def test_not_enough_disk_space(demo_snapshot, tmp_path, monkeypatch):
    # The OS's answer is replaced: a nearly full filesystem cannot be made here without root mounts.
    real = fsutil.space.shutil.disk_usage
    monkeypatch.setattr(fsutil.space.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(FlashnextError, match="not enough disk space"):
        make_mtp_int4(demo_snapshot, tmp_path / "ov", progress=False)
    assert not (tmp_path / "ov").exists() and leftovers(tmp_path, ".ov.") == []


def test_out_inside_source_is_refused(snapshot_copy):
    before = tree_digest(snapshot_copy)
    with pytest.raises(FlashnextError, match="inside the source snapshot"):
        make_mtp_int4(snapshot_copy, snapshot_copy / "ov", progress=False)
    assert tree_digest(snapshot_copy) == before


def test_failure_midway_leaves_nothing(demo_snapshot, tmp_path, monkeypatch):
    """An error after the shard writing began (here, an interrupt) removes the partial overlay."""
    import flashnext.quant.formats.packing as packing

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(packing, "pack_int32", boom)  # mtp_int4 imports it where it packs
    with pytest.raises(KeyboardInterrupt):
        make_mtp_int4(demo_snapshot, tmp_path / "ov", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_unusable_device(demo_snapshot, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(FlashnextError, match="not usable"):
        make_mtp_int4(demo_snapshot, tmp_path / "ov", MtpInt4Options(device="cuda"), progress=False)


def test_os_errors_are_one_line(demo_snapshot, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = CliRunner().invoke(make_mtp_int4_cli, ["--src", str(demo_snapshot), "--out", str(blocker / "sub" / "ov")])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output
