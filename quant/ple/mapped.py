"""The PLE table file as the serving side holds it: ``[rows, row_bytes]`` mapped read-only,
advised, gathered (patches ple-mmap and decode-06; ``serving/hooks/ple_file.py`` adapts it to
vLLM's embedding layer).

Kept in the library, beside the mapping it wraps (``prefetch.TableMapping``, which owns the
``mmap`` and the advice system calls), so that the preflight, ``ple residency`` and the tests open
the table exactly as the engine does, without importing vLLM.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.quant.ple.prefetch import DecodeAdvisor, TableMapping

DECODE_ADVICE_MAX_ROWS = 256  # 4 sequences x 16 heads x (1 + draft tokens): per-step advice


class PleTableFile:
    """The table file as ``[rows, row_bytes]``: mapped read-only, advised, gathered."""

    def __init__(self, path: Path, num_rows: int, row_bytes: int):
        if not Path(path).is_file():
            raise FlashnextError(f"VLLM_PLE_MMAP_PATH={path}: no such file; make it with `flashnext ple build`")
        self.mapping = TableMapping(Path(path), row_bytes)
        expected = num_rows * row_bytes
        if self.mapping.size != expected:
            size = self.mapping.size
            self.mapping.close()
            raise FlashnextError(
                f"{path} is {size:,} bytes; this model's PLE table is {expected:,} ({num_rows:,} rows of "
                f"{row_bytes} B): rebuild it from this checkpoint with `flashnext ple build`")
        self.path = Path(path)
        self.num_rows = num_rows
        self.row_bytes = row_bytes
        self.decode_advisor = DecodeAdvisor(self.mapping) if envs.VLLM_PLE_DECODE_ADVICE.enabled() else None

    @property
    def rows(self) -> np.ndarray:
        return self.mapping.rows

    def gather(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``ids`` (any shape of int64) as ``[n, row_bytes]`` bytes, into ``out`` if given."""
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_rows):
            raise IndexError(f"PLE row id out of range [0, {self.num_rows})")
        return np.take(self.mapping.rows, flat, axis=0, out=None if out is None else out[: flat.size])

    def advise_step(self, ids: np.ndarray) -> bool:
        """decode-06: advise a small step's rows before the gather; True if it did."""
        if self.decode_advisor is None or ids.size > DECODE_ADVICE_MAX_ROWS:
            return False
        self.decode_advisor.advise_rows(ids.reshape(-1).tolist())
        return True

    def as_tensor(self, dtype):
        """The table as a read-only ``torch`` view ``[rows, row_bytes // itemsize]`` of ``dtype``."""
        import torch

        with warnings.catch_warnings():  # the mapping is read-only on purpose: nothing writes the table
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.mapping.rows)
        return raw.view(dtype)

    def close(self) -> None:
        self.mapping.close()
