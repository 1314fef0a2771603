"""The sidecar as one record: built from its source, read back equal, and matched against a
snapshot (what the preflight asks) by the same model; and ``fsutil.atomic_file``, the output rules
``ple build`` now shares with every writer."""

import json
import os

import pytest
import torch

from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint import fsutil
from flashnext.quant.checkpoint.snapshot import Snapshot
from flashnext.quant.ple.sidecar import Sidecar, read_sidecar, sidecar_path
from flashnext.quant.ple.source import find_ple_source
from flashnext.quant.ple.table import build_table
from support.shards import rewrite_shard

PREFIX = "model.language_model.layers.1.ple.ple_embedding"


def _source(snap):
    return find_ple_source(Snapshot.open(snap))


def test_the_written_sidecar_is_the_record_from_its_source(demo_snapshot, tmp_path):
    table = tmp_path / "ple.bin"
    build_table(demo_snapshot, table, progress=False)
    sidecar = read_sidecar(table)
    source = _source(demo_snapshot)
    fresh = Sidecar.from_source(source, None)
    # Everything but the copy's results is known from the source alone.
    assert sidecar.model_dump(exclude={"shards", "table_stat"}) == fresh.model_dump(exclude={"shards", "table_stat"})
    assert [s.name for s in sidecar.shards] == [s.name for s in source.shards]
    assert sidecar.table_stat.size == table.stat().st_size == source.file_size
    assert json.loads(sidecar_path(table).read_text()) == sidecar.model_dump(mode="json")
    assert sidecar.matches(source) and sidecar.mismatches(source) == []


def _preflight_says_same_checkpoint(sidecar, source) -> bool:
    """serving/preflight.py:check_ple_table's own comparison, until it calls Sidecar.matches."""
    layout = source.layout
    return (sidecar.rows, sidecar.row_bytes, sidecar.dtype, sidecar.layout.multipliers,
            sidecar.layout.head_sizes) == (layout.padded_rows, source.row_bytes, source.dtype,
                                           list(layout.multipliers), list(layout.head_sizes))


def _multipliers(snap):
    def edit(t):
        t[f"{PREFIX}.layer_multipliers"] = t[f"{PREFIX}.layer_multipliers"] + 2
    rewrite_shard(snap / "model-00001-of-00005.safetensors", edit)


def _offsets(snap):
    def edit(t):
        name = f"{PREFIX}.ngram_heads_offsets"
        t[name] = t[name].clone()
        t[name][-1] += 1
    rewrite_shard(snap / "model-00001-of-00005.safetensors", edit)


def _eos(snap):
    cfg = json.loads((snap / "config.json").read_text())
    cfg["text_config"]["eos_token_id"] = cfg["text_config"]["eos_token_id"] + 1
    (snap / "config.json").write_text(json.dumps(cfg))


def _fp8(snap):
    def edit(t):
        for k in list(t):
            if ".ngram_embedding.shard_" in k:
                t[k] = t[k].float().clamp(-400, 400).to(torch.float8_e4m3fn)
        t[f"{PREFIX}.ngram_embedding.weight_scale"] = torch.tensor([0.015625], dtype=torch.float32)
    rewrite_shard(snap / "model-00003-of-00005.safetensors", edit)
    index = json.loads((snap / "model.safetensors.index.json").read_text())
    index["weight_map"][f"{PREFIX}.ngram_embedding.weight_scale"] = "model-00003-of-00005.safetensors"
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))


# what changes in the snapshot -> whether the table built before still serves it
CHANGES = {
    "multipliers": (_multipliers, False),
    "head-offsets": (_offsets, True),
    "eos-token": (_eos, True),
    "fp8": (_fp8, False),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_matches_agrees_with_the_preflight_comparison(change, demo_snapshot, snapshot_copy, tmp_path):
    """Agreement test: Sidecar.matches and the preflight's five-field tuple say the same of a table
    and a changed snapshot, so preflight can call matches with no change for users."""
    table = tmp_path / "ple.bin"
    build_table(demo_snapshot, table, progress=False)
    sidecar = read_sidecar(table)
    edit, still_serves = CHANGES[change]
    try:
        edit(snapshot_copy)
    except KeyError:
        pytest.skip(f"the demo checkpoint has no buffer for {change}")
    source = _source(snapshot_copy)
    assert sidecar.matches(source) is still_serves
    assert _preflight_says_same_checkpoint(sidecar, source) is still_serves


def test_a_sidecar_that_cannot_be_read_back_is_refused_before_writing(demo_snapshot, tmp_path):
    source = _source(demo_snapshot)
    source.scale = 0.5  # a BF16 table has no global scale
    with pytest.raises(FlashnextError, match="a BF16 table has no global scale"):
        Sidecar.from_source(source, None)


def test_a_sidecar_of_another_format_is_said_to_be_one(demo_snapshot, tmp_path):
    table = tmp_path / "ple.bin"
    build_table(demo_snapshot, table, progress=False)
    data = json.loads(sidecar_path(table).read_text())
    for bad, words in (({**data, "format": "x"}, "not a flashnext.ple-table/1 sidecar"),
                       ({**data, "rows": "5"}, "rows must be an integer, got '5'"),
                       ({**data, "surprise": 1}, "unknown keys ['surprise']")):
        sidecar_path(table).write_text(json.dumps(bad))
        with pytest.raises(FlashnextError, match=words.replace("[", r"\[").replace("(", r"\(")):
            read_sidecar(table)


# --- fsutil.atomic_file ---------------------------------------------------------------------------

def _write(out, force=False, is_ours=lambda p: p.read_bytes().startswith(b"ours"), data=b"ours: new"):
    with fsutil.atomic_file(out, force, {}, is_ours=is_ours, maker="this test") as output:
        fd = output.create(".partial")
        os.write(fd, data)
        os.fsync(fd)
        st = os.fstat(fd)
        os.close(fd)
        output.commit(".partial", st)


def test_atomic_file_writes_refuses_and_replaces_only_its_own(tmp_path):
    out = tmp_path / "a" / "b" / "out.bin"
    _write(out)
    assert out.read_bytes() == b"ours: new" and not (out.parent / ".out.bin.lock").exists()
    with pytest.raises(FlashnextError, match="already exists"):
        _write(out)
    _write(out, force=True, data=b"ours: newer")
    assert out.read_bytes() == b"ours: newer"
    out.write_bytes(b"theirs")
    with pytest.raises(FlashnextError, match="was not made by this test"):
        _write(out, force=True)
    assert out.read_bytes() == b"theirs"


def test_atomic_file_leaves_no_parent_it_made_on_failure(tmp_path):
    out = tmp_path / "new" / "deeper" / "out.bin"
    with pytest.raises(RuntimeError):
        with fsutil.atomic_file(out, False, {}, is_ours=lambda p: True, maker="x"):
            raise RuntimeError
    assert list(tmp_path.iterdir()) == []


def test_atomic_file_never_commits_a_swapped_partial(tmp_path):
    out = tmp_path / "out.bin"
    with pytest.raises(FlashnextError, match="was replaced while it was being written"):
        with fsutil.atomic_file(out, False, {}, is_ours=lambda p: True, maker="x") as output:
            fd = output.create(".partial")
            st = os.fstat(fd)
            os.close(fd)
            os.rename(tmp_path / ".partial", tmp_path / ".moved")
            (tmp_path / ".partial").write_bytes(b"planted")
            output.commit(".partial", st)
    assert not out.exists()


def test_atomic_file_refuses_an_output_inside_an_input(tmp_path):
    (tmp_path / "in").mkdir()
    with pytest.raises(FlashnextError, match="lies inside the input"):
        with fsutil.atomic_file(tmp_path / "in" / "out.bin", False, {"the input": tmp_path / "in"},
                                is_ours=lambda p: True, maker="x"):
            pass
