"""flashnext ple build / verify on the demo checkpoint, resumption, and every bad input."""

import hashlib
import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from flashnext.quant.checkpoint import fsutil
from flashnext.errors import FlashnextError
from flashnext.quant.ple.layout import ple_layout
from flashnext.quant.ple.table import build_table, find_ple_source, verify_table
from flashnext.quant.checkpoint.snapshot import Snapshot
from flashnext.tools.cli import main as cli
from support.shards import rewrite_shard

PREFIX = "model.language_model.layers.1.ple.ple_embedding"
PLE_SHARD = "model-00003-of-00005.safetensors"


def test_table_is_the_shards_concatenated(demo_snapshot, tmp_path):
    out = tmp_path / "ple.bin"
    result = CliRunner().invoke(cli, ["ple", "build", "--src", str(demo_snapshot), "--out", str(out), "--json",
                                      "--no-progress"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    tensors = load_file(demo_snapshot / PLE_SHARD)
    shards = [tensors[f"{PREFIX}.ngram_embedding.shard_{i}.weight"] for i in range(4)]
    expected = torch.cat(shards).contiguous().view(torch.uint8).numpy().tobytes()
    assert out.read_bytes() == expected
    layout = ple_layout(json.loads((demo_snapshot / "config.json").read_text())["text_config"])
    assert info["rows"] == layout.padded_rows and info["file_size"] == layout.padded_rows * layout.head_dim * 2
    sidecar = json.loads((tmp_path / "ple.bin.json").read_text())
    assert sidecar["dtype"] == "BF16" and sidecar["row_bytes"] == 32
    assert [s["sha256"] for s in sidecar["shards"]] == [
        hashlib.sha256(s.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for s in shards]
    assert verify_table(out)["ok"] and verify_table(out, full=True)["ok"]
    assert not (tmp_path / "ple.bin.partial").exists() and not (tmp_path / "ple.bin.partial.json").exists()


def test_verify_finds_a_flipped_byte(demo_snapshot, tmp_path):
    out = tmp_path / "ple.bin"
    build_table(demo_snapshot, out, progress=False)
    with open(out, "r+b") as f:
        f.seek(200_000)
        b = f.read(1)
        f.seek(200_000)
        f.write(bytes([b[0] ^ 1]))
    result = CliRunner().invoke(cli, ["ple", "verify", str(out), "--full"])
    assert result.exit_code != 0 and "differs from its source" in result.output
    os.truncate(out, 1000)
    result = CliRunner().invoke(cli, ["ple", "verify", str(out)])
    assert result.exit_code != 0 and "needs exactly" in result.output


def test_resume_after_interruption(demo_snapshot, tmp_path, monkeypatch):
    import flashnext.quant.ple.table as mod

    out = tmp_path / "ple.bin"
    real_copy = mod._copy_shard
    calls = []

    def interrupted(shard, *a, **k):
        if shard.index == 2:
            raise KeyboardInterrupt
        calls.append(shard.index)
        return real_copy(shard, *a, **k)

    monkeypatch.setattr(mod, "_copy_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_table(demo_snapshot, out, progress=False)
    assert not out.exists() and (tmp_path / "ple.bin.partial").exists()
    assert calls == [0, 1]
    calls.clear()
    monkeypatch.setattr(mod, "_copy_shard", lambda shard, *a, **k: (calls.append(shard.index), real_copy(shard, *a, **k))[1])
    build_table(demo_snapshot, out, progress=False)
    assert calls == [2, 3]  # shards 0 and 1 were not copied again
    assert verify_table(out, full=True)["ok"]


def test_buffers_in_the_checkpoint_win(snapshot_copy):
    name = f"{PREFIX}.layer_multipliers"

    def edit(t):
        t[name] = t[name] + 2  # still odd, just not the formula's

    tensors = rewrite_shard(snapshot_copy / "model-00001-of-00005.safetensors", edit)
    source = find_ple_source(Snapshot.open(snapshot_copy))
    assert list(source.layout.multipliers) == tensors[name].tolist()
    assert len(source.differences) == 1 and "layer_multipliers" in source.differences[0]


def _index(snap):
    return json.loads((snap / "model.safetensors.index.json").read_text())


def _write_index(snap, index):
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))


def _drop_shard(snap):
    index = _index(snap)
    del index["weight_map"][f"{PREFIX}.ngram_embedding.shard_3.weight"]
    _write_index(snap, index)


def _extra_shard(snap):
    def edit(t):
        t[f"{PREFIX}.ngram_embedding.shard_4.weight"] = torch.zeros(8, 16, dtype=torch.bfloat16)

    rewrite_shard(snap / PLE_SHARD, edit)
    index = _index(snap)
    index["weight_map"][f"{PREFIX}.ngram_embedding.shard_4.weight"] = PLE_SHARD
    _write_index(snap, index)


def _rewrite(snap, edit):
    rewrite_shard(snap / PLE_SHARD, edit)


def _rows(t):
    n = f"{PREFIX}.ngram_embedding.shard_1.weight"
    t[n] = t[n][:-4].clone()


def _dtype(t):
    n = f"{PREFIX}.ngram_embedding.shard_2.weight"
    t[n] = t[n].to(torch.float16)


def _config(snap):
    cfg = json.loads((snap / "config.json").read_text())
    cfg["text_config"]["make_ngram_vocab_size_divisible_by"] = 4096
    (snap / "config.json").write_text(json.dumps(cfg))


BAD = {
    "missing shard": (_drop_shard, "is missing"),
    "extra shard": (_extra_shard, "extra PLE shard"),
    "rows disagree with config": (lambda s: _rewrite(s, _rows), "config.json implies"),
    "config disagrees with shards": (_config, "config.json implies"),
    "mixed dtypes": (lambda s: _rewrite(s, _dtype), "mixed dtypes"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_snapshot(snapshot_copy, tmp_path, case):
    breaker, message = BAD[case]
    breaker(snapshot_copy)
    out = tmp_path / "ple.bin"
    result = CliRunner().invoke(cli, ["ple", "build", "--src", str(snapshot_copy), "--out", str(out), "--no-progress"])
    assert result.exit_code != 0 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "ple.bin.partial").exists()


def test_existing_target_of_the_wrong_size(demo_snapshot, tmp_path):
    out = tmp_path / "ple.bin"
    out.write_bytes(b"x" * 100)
    result = CliRunner().invoke(cli, ["ple", "build", "--src", str(demo_snapshot), "--out", str(out)])
    assert result.exit_code != 0 and "is 100 bytes, not the" in result.output
    assert out.read_bytes() == b"x" * 100
    # --force replaces only a table flashnext built (it has a sidecar), never a user's file.
    result = CliRunner().invoke(cli, ["ple", "build", "--src", str(demo_snapshot), "--out", str(out), "--force",
                                      "--no-progress"])
    assert result.exit_code == 1 and "was not made by `flashnext ple build`" in result.output
    assert out.read_bytes() == b"x" * 100
    out.unlink()
    for _ in range(2):
        result = CliRunner().invoke(cli, ["ple", "build", "--src", str(demo_snapshot), "--out", str(out), "--force",
                                          "--no-progress"])
        assert result.exit_code == 0 and verify_table(out)["ok"]


def test_not_enough_disk_space(demo_snapshot, tmp_path, monkeypatch):
    real = fsutil.space.shutil.disk_usage
    monkeypatch.setattr(fsutil.space.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(FlashnextError, match="not enough disk space"):
        build_table(demo_snapshot, tmp_path / "ple.bin", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_ids_command(demo_snapshot):
    result = CliRunner().invoke(cli, ["ple", "ids", "--config", str(demo_snapshot / "config.json"),
                                      "--tokens", "1,2,3", "--context", "5,6"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert np.array(rows).shape == (3, 16)
    bad = CliRunner().invoke(cli, ["ple", "ids", "--config", str(demo_snapshot / "config.json"),
                                   "--tokens", "1", "--context", "5"])
    assert bad.exit_code != 0 and "exactly 2" in bad.output


def _to_fp8(snap, with_scale=True):
    def edit(tensors):
        for k in list(tensors):
            if ".ngram_embedding.shard_" in k:
                tensors[k] = tensors[k].float().clamp(-400, 400).to(torch.float8_e4m3fn)
        if with_scale:
            tensors[f"{PREFIX}.ngram_embedding.weight_scale"] = torch.tensor([0.015625], dtype=torch.float32)

    tensors = rewrite_shard(snap / PLE_SHARD, edit)
    if with_scale:
        index = _index(snap)
        index["weight_map"][f"{PREFIX}.ngram_embedding.weight_scale"] = PLE_SHARD
        _write_index(snap, index)
    return tensors


def test_fp8_table_keeps_its_scale(snapshot_copy, tmp_path):
    tensors = _to_fp8(snapshot_copy)
    out = tmp_path / "ple-fp8.bin"
    info = build_table(snapshot_copy, out, progress=False)
    assert info["dtype"] == "F8_E4M3" and info["row_bytes"] == 16 and info["scale"] == 0.015625
    expected = torch.cat([tensors[f"{PREFIX}.ngram_embedding.shard_{i}.weight"] for i in range(4)])
    assert out.read_bytes() == expected.view(torch.uint8).numpy().tobytes()
    assert json.loads((tmp_path / "ple-fp8.bin.json").read_text())["scale"] == 0.015625
    assert verify_table(out, full=True)["ok"]


def test_fp8_without_scale_is_refused(snapshot_copy, tmp_path):
    _to_fp8(snapshot_copy, with_scale=False)
    with pytest.raises(FlashnextError, match="global scale"):
        build_table(snapshot_copy, tmp_path / "t.bin", progress=False)
