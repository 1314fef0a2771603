import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from hypothesis import given, settings
from hypothesis import strategies as st

from flashnext.errors import FlashnextError
from flashnext.quant.formats.packing import pack_int32, packed_words, unpack_int32


def reference_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Bit-by-bit reference of the dense layout: element i at stream bits [i*b, i*b+b)."""
    rows, cols = codes.shape
    words = packed_words(cols, bits)
    out = torch.zeros(rows, words, dtype=torch.int64)
    for r in range(rows):
        for i in range(cols):
            u = int(codes[r, i]) + (1 << (bits - 1))
            for bit in range(bits):
                if u >> bit & 1:
                    pos = i * bits + bit
                    out[r, pos // 32] |= 1 << (pos % 32)
    out = torch.where(out >= 1 << 31, out - (1 << 32), out)
    return out.to(torch.int32)


def random_codes(rows, cols, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    return torch.randint(lo, hi, (rows, cols), generator=g, dtype=torch.int8)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("cols", [1, 5, 31, 32, 33, 64, 100])
def test_matches_bitwise_reference(bits, cols):
    codes = random_codes(3, cols, bits, seed=bits * 1000 + cols)
    packed = pack_int32(codes, bits)
    assert packed.shape == (3, packed_words(cols, bits))
    assert torch.equal(packed, reference_pack(codes, bits))
    assert torch.equal(unpack_int32(packed, bits, cols), codes)


def test_every_6bit_value_at_every_block_position():
    values = torch.arange(-32, 32, dtype=torch.int8)
    # row v*32+p puts value v at position p of a 32-value block, everything else a fixed pattern
    rows = []
    for v in values:
        for p in range(32):
            row = torch.full((32,), -1, dtype=torch.int8)
            row[p] = v
            rows.append(row)
    codes = torch.stack(rows)
    packed = pack_int32(codes, 6)
    assert packed.shape == (64 * 32, 6)
    assert torch.equal(packed, reference_pack(codes, 6))
    assert torch.equal(unpack_int32(packed, 6, 32), codes)


@pytest.mark.parametrize("bits", [4, 8])
def test_bit_exact_with_compressed_tensors(bits):
    codes = random_codes(16, 256, bits, seed=bits)
    ours = pack_int32(codes, bits)
    assert torch.equal(ours, pack_to_int32(codes, bits))
    assert torch.equal(unpack_from_int32(ours, bits, torch.Size([16, 256])), codes)


def test_padded_6bit_layout_of_compressed_tensors_017_is_refused():
    # compressed-tensors 0.17 packs 6-bit padded (5 per word); its width cannot be read as dense.
    codes = random_codes(4, 64, 6)
    padded = pack_to_int32(codes, 6)
    assert padded.shape[1] != packed_words(64, 6)
    with pytest.raises(FlashnextError, match="packing layout"):
        unpack_int32(padded, 6, 64)


def test_out_of_range_codes_are_refused():
    with pytest.raises(FlashnextError, match="range"):
        pack_int32(torch.tensor([[8]], dtype=torch.int8), 4)


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), rows=st.integers(1, 4), cols=st.integers(1, 97), seed=st.integers(0, 2**31))
def test_round_trip_property(bits, rows, cols, seed):
    codes = random_codes(rows, cols, bits, seed)
    assert torch.equal(unpack_int32(pack_int32(codes, bits), bits, cols), codes)
