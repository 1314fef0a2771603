"""Dense little-endian n-bit packing into int32 words, compressed-tensors' ``pack-quantized`` layout.

Element ``i`` of a row occupies bits ``[i*b, i*b + b)`` of the row's bit stream, least significant
bit first; the stream is cut into int32 words, so a row of ``K`` values takes ``ceil(K*b/32)`` words
and, when ``b`` does not divide 32, a value may straddle two words. Stored values are offset by
``2**(b-1)`` so that a signed code ``q`` in ``[-2**(b-1), 2**(b-1) - 1]`` is kept as ``q + 2**(b-1)``.

For b in {4, 8} every compressed-tensors version writes exactly this; for b = 6 compressed-tensors
0.17 (the one vLLM 0.34.0 pins) writes a *padded* layout (5 values per word) instead, which this
module never produces.
"""

from __future__ import annotations

import sys

import torch

from flashnext.errors import FlashnextError

# For 4 and 8 bits the int32 words, read as little-endian bytes, are just the values in order
# (two nibbles per byte, low nibble first, for 4 bits), which packs without 64-bit temporaries.
_BYTE_VIEW = sys.byteorder == "little"

SUPPORTED_BITS = tuple(range(1, 9))


def packed_words(num_values: int, bits: int) -> int:
    """Number of int32 words that hold ``num_values`` values of ``bits`` bits densely."""
    return (num_values * bits + 31) // 32


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise FlashnextError(f"cannot pack {bits}-bit values: supported widths are 1..8")


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed codes ``[rows, K]`` (any integer dtype) into int32 ``[rows, ceil(K*bits/32)]``."""
    _check_bits(bits)
    if codes.dim() != 2:
        raise FlashnextError(f"pack_int32 takes a 2-D tensor, got shape {tuple(codes.shape)}")
    rows, cols = codes.shape
    offset = 1 << (bits - 1)
    lo, hi = -offset, offset - 1
    if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
        raise FlashnextError(f"codes out of the signed {bits}-bit range [{lo}, {hi}]")
    words = packed_words(cols, bits)
    if _BYTE_VIEW and bits in (4, 8):
        per_word = 32 // bits
        codes8 = codes.to(torch.int8)
        # +8 stays within int8 for 4-bit codes; +128 is a flip of the sign bit for 8-bit ones.
        u8 = (codes8 + offset).view(torch.uint8) if bits == 4 else codes8.view(torch.uint8) ^ 0x80
        if words * per_word != cols:
            u8 = torch.nn.functional.pad(u8, (0, words * per_word - cols))
        if bits == 4:
            u8 = u8[:, 0::2] | (u8[:, 1::2] << 4)
        return u8.contiguous().view(torch.int32)
    unsigned = (codes.to(torch.int64) + offset)
    if 32 % bits == 0:
        per_word = 32 // bits
        padded = words * per_word
        if padded != cols:
            unsigned = torch.nn.functional.pad(unsigned, (0, padded - cols))
        shifts = torch.arange(per_word, device=codes.device, dtype=torch.int64) * bits
        packed = (unsigned.view(rows, words, per_word) << shifts).sum(dim=-1)
    else:
        # 32 values fill exactly `bits` words; walk the 32 positions of a block, each of which
        # lands in one word and may spill its high bits into the next.
        blocks = (cols + 31) // 32
        if blocks * 32 != cols:
            unsigned = torch.nn.functional.pad(unsigned, (0, blocks * 32 - cols))
        unsigned = unsigned.view(rows, blocks, 32)
        stream = torch.zeros(rows, blocks, bits, dtype=torch.int64, device=codes.device)
        for i in range(32):
            word, shift = divmod(i * bits, 32)
            value = unsigned[:, :, i]
            stream[:, :, word] |= (value << shift) & 0xFFFFFFFF
            if shift + bits > 32:
                stream[:, :, word + 1] |= value >> (32 - shift)
        packed = stream.view(rows, blocks * bits)[:, :words]
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)
    return packed.to(torch.int32)


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 ``[rows, ceil(cols*bits/32)]`` to int8 codes ``[rows, cols]``.

    A packed width that does not match ``cols`` densely (for instance compressed-tensors 0.17's
    padded 6-bit layout) is refused rather than misread.
    """
    _check_bits(bits)
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise FlashnextError(
            f"unpack_int32 takes a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    rows, width = packed.shape
    words = packed_words(cols, bits)
    if width != words:
        raise FlashnextError(
            f"packed width {width} does not match {cols} dense {bits}-bit values "
            f"(expected {words} int32 words per row); is this another packing layout?")
    offset = 1 << (bits - 1)
    mask = (1 << bits) - 1
    if _BYTE_VIEW and bits in (4, 8):
        u8 = packed.contiguous().view(torch.uint8)
        if bits == 4:
            u8 = torch.stack((u8 & 0xF, u8 >> 4), dim=-1).view(rows, -1)
        u8 = u8[:, :cols]
        return (u8.to(torch.int8) - offset) if bits == 4 else (u8 ^ 0x80).view(torch.int8)
    stream = packed.to(torch.int64) & 0xFFFFFFFF
    if 32 % bits == 0:
        per_word = 32 // bits
        shifts = torch.arange(per_word, device=packed.device, dtype=torch.int64) * bits
        values = ((stream.unsqueeze(-1) >> shifts) & mask).view(rows, words * per_word)
    else:
        blocks = (cols + 31) // 32
        if blocks * bits != width:
            stream = torch.nn.functional.pad(stream, (0, blocks * bits - width))
        stream = stream.view(rows, blocks, bits)
        values = torch.empty(rows, blocks, 32, dtype=torch.int64, device=packed.device)
        for i in range(32):
            word, shift = divmod(i * bits, 32)
            value = stream[:, :, word] >> shift
            if shift + bits > 32:
                value = value | (stream[:, :, word + 1] << (32 - shift))
            values[:, :, i] = value & mask
        values = values.view(rows, blocks * 32)
    return (values[:, :cols] - offset).to(torch.int8)


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weights ``q * s[group]`` from integer codes ``[rows, cols]`` and group scales
    ``[rows, cols / group]``, computed in fp32 (exact for a bf16 scale) and cast to ``dtype``."""
    rows, cols = codes.shape
    if scales.shape[0] != rows or cols % scales.shape[1]:
        raise FlashnextError(f"scales {list(scales.shape)} are no group scaling of [{rows}, {cols}]")
    groups = codes.float().view(rows, scales.shape[1], -1) * scales.float().unsqueeze(-1)
    return groups.view(rows, cols).to(dtype)
