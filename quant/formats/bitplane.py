"""The INT6 bit-plane layout: 6-bit weights regrouped as a 4-bit plane and a 2-bit plane.

compressed-tensors' dense 6-bit ``pack-quantized`` layout (``quant.formats.packing``) puts 32 values in 6
int32 words with values straddling words, which a decode GEMV must unpack with variable shifts.
Seed 000 §3.3 regroups each matrix, at the same byte count, so a kernel reads it with plain shifts.

Byte layout of ``weight_packed`` in this layout (``uint8 [N, 3K/4]``, one contiguous allocation),
for row ``n`` and stored value ``u = q + 32`` (0..63):

* bytes ``[0, K/2)``, the low plane: byte ``j`` holds ``u[2j] & 15`` in bits 0-3 and
  ``u[2j+1] & 15`` in bits 4-7;
* bytes ``[K/2, 3K/4)``, the high plane: byte ``j`` holds ``u[4j+i] >> 4`` in bits ``2i..2i+1``
  for ``i = 0..3``.

That is ``3K/4`` bytes per row, exactly the dense layout's ``4 * 6K/32`` when ``K`` is a multiple
of 16 (every real shape is a multiple of 64); other ``K`` are refused. The tensor keeps the name
``weight_packed`` but becomes ``uint8`` of a different shape, so an unpatched loader fails loudly
on the shape instead of reading it as dense INT6.

Which modules are in this layout is recorded in config.json's ``flashnext.int6_bitplane``
(:class:`BitplaneRecord`): ``repack-int6`` writes it and reads it back to reverse, and the serving
patch reads it to choose its method, so the record and its layout check live here, with the layout.
"""

from __future__ import annotations

from typing import Any

import torch

from flashnext.errors import FlashnextError
from flashnext.quant.formats.packing import pack_int32, unpack_int32
from flashnext.quant.records.strict import StrictRecord

LAYOUT = "flashnext.bitplane6/1"
# Where the record sits in config.json: config["flashnext"]["int6_bitplane"].
SECTION, RECORD_KEY = "flashnext", "int6_bitplane"


class BitplaneRecord(StrictRecord):
    """config.json's ``flashnext.int6_bitplane``: the modules (checkpoint names) whose
    ``weight_packed`` is in :data:`LAYOUT`."""

    layout: str
    modules: list[str]

    @classmethod
    def not_this_record(cls, data: Any) -> str | None:
        if isinstance(data, dict) and "layout" in data and data["layout"] != LAYOUT:
            return (f"has layout {data['layout']!r}; this flashnext reads {LAYOUT!r}. Rebuild the overlay with "
                    "this version's repack-int6.")
        return None

    @classmethod
    def from_config(cls, config: Any, where: str = "config.json") -> "BitplaneRecord | None":
        """The record of ``config`` (config.json as a dict, or vLLM's ``hf_config``, which carries
        the section as an attribute); None without one. One of another layout, or malformed, is
        refused in one line."""
        from flashnext.quant.records.jsonfile import validate

        section = config.get(SECTION) if isinstance(config, dict) else getattr(config, SECTION, None)
        if section is None:
            return None
        if not isinstance(section, dict):
            raise FlashnextError(f"{where}: {SECTION} must be a JSON object")
        record = section.get(RECORD_KEY)
        if record is None:
            return None
        return validate(record, cls, f"{where}: {SECTION}.{RECORD_KEY}")

    def into(self, config: dict) -> None:
        """Write this record into config.json's dict ``config``."""
        config.setdefault(SECTION, {})[RECORD_KEY] = self.model_dump(mode="json")

    @staticmethod
    def remove_from(config: dict) -> None:
        """Take the record out of ``config`` (and the ``flashnext`` section, when that empties it)."""
        section = config.get(SECTION)
        if isinstance(section, dict):
            section.pop(RECORD_KEY, None)
            if not section:
                config.pop(SECTION)


def _check_k(cols: int) -> None:
    if cols % 16:
        raise FlashnextError(f"K={cols} is not a multiple of 16: the bit-plane layout would not keep the "
                             "dense layout's byte count")


def bitplane_bytes(rows: int, cols: int) -> tuple[int, int]:
    _check_k(cols)
    return rows, cols * 3 // 4


def codes_to_bitplane(codes: torch.Tensor) -> torch.Tensor:
    """Signed 6-bit codes ``[N, K]`` to the bit-plane bytes ``uint8 [N, 3K/4]``."""
    rows, cols = codes.shape
    _check_k(cols)
    u = (codes.to(torch.int16) + 32).to(torch.uint8)
    lo = u & 0xF
    hi = u >> 4
    out = torch.empty(rows, cols * 3 // 4, dtype=torch.uint8, device=codes.device)
    out[:, : cols // 2] = lo[:, 0::2] | (lo[:, 1::2] << 4)
    out[:, cols // 2:] = hi[:, 0::4] | (hi[:, 1::4] << 2) | (hi[:, 2::4] << 4) | (hi[:, 3::4] << 6)
    return out


def bitplane_to_codes(planes: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of :func:`codes_to_bitplane`; a shape that does not fit ``cols`` is refused."""
    if planes.dtype != torch.uint8 or planes.dim() != 2 or planes.shape[1] != cols * 3 // 4:
        raise FlashnextError(f"not a bit-plane tensor for K={cols}: got {planes.dtype} {list(planes.shape)}")
    _check_k(cols)
    rows = planes.shape[0]
    lo_bytes, hi_bytes = planes[:, : cols // 2], planes[:, cols // 2:]
    lo = torch.stack((lo_bytes & 0xF, lo_bytes >> 4), dim=-1).view(rows, cols)
    hi = torch.stack([(hi_bytes >> s) & 0x3 for s in (0, 2, 4, 6)], dim=-1).view(rows, cols)
    return ((hi << 4) | lo).to(torch.int16).sub(32).to(torch.int8)


def dense6_to_bitplane(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """compressed-tensors dense 6-bit ``int32 [N, 6K/32]`` to bit-plane ``uint8 [N, 3K/4]``."""
    return codes_to_bitplane(unpack_int32(packed, 6, cols))


def bitplane_to_dense6(planes: torch.Tensor, cols: int) -> torch.Tensor:
    return pack_int32(bitplane_to_codes(planes, cols), 6)


def dense6_to_int8(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Lossless widening: the same codes in the 8-bit pack-quantized layout (value q+128)."""
    return pack_int32(unpack_int32(packed, 6, cols), 8)
