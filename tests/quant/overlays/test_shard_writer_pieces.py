"""What a :class:`ShardWriter` knows it wrote, and how a resumed one checks it: the pieces a
resumable build's journal records, each with its sha256, checked against the shard's bytes before
the build goes on in it."""

from __future__ import annotations

import hashlib

import pytest
import torch

from flashnext.errors import FlashnextError
from flashnext.quant.formats.safetensors_io import ShardWriter, TensorSpec, WrittenBytes, read_header

SPECS = [TensorSpec("a", "U8", (64,)), TensorSpec("b", "U8", (32,)), TensorSpec("empty", "U8", (0,))]


def begun(path, **kwargs) -> ShardWriter:
    """A shard with 16 bytes at 0 and 16 at 32 of ``a`` written, then left for a resume."""
    writer = ShardWriter(path, SPECS, digests=True, **kwargs)
    writer.write_bytes("a", bytes(range(16)), 0)
    writer.write_bytes("a", bytes(range(16, 32)), 32)
    writer.sync()
    return writer


def test_each_piece_is_recorded_with_its_digest(tmp_path):
    writer = begun(tmp_path / "s.safetensors")
    assert writer.written == [WrittenBytes("a", 0, 16, hashlib.sha256(bytes(range(16))).hexdigest()),
                              WrittenBytes("a", 32, 16, hashlib.sha256(bytes(range(16, 32))).hexdigest())]
    assert writer.holds("a", 0, 16) and writer.holds("a", 36, 8) and writer.holds("empty", 0, 0)
    assert not writer.holds("a", 0, 17) and not writer.holds("a", 16, 1) and not writer.holds("b", 0, 1)
    writer.abort()


def test_a_piece_written_over_replaces_those_it_overlaps(tmp_path):
    writer = begun(tmp_path / "s.safetensors")
    writer.write_bytes("a", bytes(40), 8)  # over the end of the first and the whole of the second
    assert [(p.offset, p.length) for p in writer.written] == [(8, 40)]
    assert writer.holds("a", 8, 40) and not writer.holds("a", 0, 8)
    writer.abort()


def test_a_tensor_is_complete_only_when_every_byte_was_written(tmp_path):
    """Its last piece alone does not make it so."""
    writer = ShardWriter(tmp_path / "s.safetensors", SPECS)
    writer.write_bytes("a", bytes(8), 56)
    writer.write("b", torch.zeros(32, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"1 tensors never written, e.g. \['a'\]"):
        writer.close()


def test_a_resumed_writer_checks_every_piece_and_goes_on(tmp_path):
    path = tmp_path / "s.safetensors"
    first = begun(path)
    pieces = first.written
    first.abort()
    writer = ShardWriter(path, SPECS, resumed=pieces)
    assert writer.written == pieces and writer.read_bytes("a", 32, 16) == bytes(range(16, 32))
    writer.write_bytes("a", bytes(16), 16)
    writer.write_bytes("a", bytes(16), 48)
    writer.write("b", torch.ones(32, dtype=torch.uint8))
    writer.close()
    header = read_header(path)
    data = path.read_bytes()
    assert data[header.entries["a"].begin:header.entries["a"].end] == \
        bytes(range(16)) + bytes(16) + bytes(range(16, 32)) + bytes(16)


def changed(path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(read_header(path).entries["a"].begin + at)
        f.write(data)


@pytest.mark.parametrize("change, why", [
    (lambda path, pieces: changed(path, 33, b"\xff"), r"bytes 32\.\.48 of a are not those written there"),
    (lambda path, pieces: changed(path, 0, bytes(16)), r"bytes 0\.\.16 of a are not those written there"),
    (lambda path, pieces: pieces.append(WrittenBytes("c", 0, 1, "0" * 64)), "has no tensor 'c'"),
    (lambda path, pieces: pieces.append(WrittenBytes("b", 16, 17, "0" * 64)), r"b has no bytes 16\.\.33"),
    (lambda path, pieces: pieces.append(WrittenBytes("b", 0, 8, "0" * 64)), r"bytes 0\.\.8 of b are not those"),
], ids=["bit-flipped", "zeroed", "unknown-tensor", "past-the-end", "another-digest"])
def test_a_resumed_writer_refuses_what_does_not_check_out(change, why, tmp_path):
    path = tmp_path / "s.safetensors"
    first = begun(path, shown=tmp_path / "shown.safetensors")
    pieces = first.written
    first.abort()
    change(path, pieces)
    with pytest.raises(FlashnextError, match=why) as e:
        ShardWriter(path, SPECS, resumed=pieces, shown=tmp_path / "shown.safetensors")
    assert str(e.value).startswith(f"{tmp_path / 'shown.safetensors'}")
