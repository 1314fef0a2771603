import struct

import pytest
import torch
from safetensors.torch import load_file

from flashnext.errors import FlashnextError
from flashnext.quant.formats.safetensors_io import ShardWriter, read_header, spec_of


def test_writer_output_loads_with_safetensors_in_any_write_order(tmp_path):
    tensors = {"b": torch.arange(7, dtype=torch.int32), "a": torch.randn(3, 5).to(torch.bfloat16),
               "c": torch.tensor([1, 2], dtype=torch.int64)}
    path = tmp_path / "x.safetensors"
    with ShardWriter(path, [spec_of(k, v) for k, v in tensors.items()], {"format": "pt"}) as w:
        for k in ("c", "a", "b"):
            w.write(k, tensors[k])
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + length) % 8 == 0
    header = read_header(path)
    assert header.metadata == {"format": "pt"} and header.file_size == path.stat().st_size


def test_unwritten_tensor_is_an_error(tmp_path):
    w = ShardWriter(tmp_path / "x.safetensors", [spec_of("a", torch.zeros(2))])
    with pytest.raises(RuntimeError, match="never written"):
        w.close()


def test_wrong_shape_is_an_error(tmp_path):
    with ShardWriter(tmp_path / "x.safetensors", [spec_of("a", torch.zeros(2))]) as w:
        with pytest.raises(ValueError):
            w.write("a", torch.zeros(3))
        w.write("a", torch.zeros(2))


@pytest.mark.parametrize("data,message", [(b"", "not a safetensors"), (b"\xff" * 8, "implausible"),
                                         (struct.pack("<Q", 3) + b"{no", "JSON"), (struct.pack("<Q", 9) + b"{}", "truncated")])
def test_malformed_headers(tmp_path, data, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(FlashnextError, match=message):
        read_header(path)
