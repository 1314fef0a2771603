"""The library half of patches ple-mmap and decode-06: the table file as the serving patch opens it."""

import numpy as np
import pytest

from flashnext.errors import FlashnextError
from flashnext.serving.hooks.ple_file import DECODE_ADVICE_MAX_ROWS, PleTableFile


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "table.bin"
    rows = np.arange(1000 * 320, dtype=np.uint32).astype(np.uint8).reshape(1000, 320)
    path.write_bytes(rows.tobytes())
    return path, rows


def test_gather_reads_the_rows(table):
    path, rows = table
    t = PleTableFile(path, 1000, 320)
    ids = np.array([[3, 999], [0, 512]])
    assert np.array_equal(t.gather(ids), rows[ids.reshape(-1)])
    out = np.empty((8, 320), dtype=np.uint8)
    t.gather(ids, out=out)
    assert np.array_equal(out[:4], rows[ids.reshape(-1)])
    with pytest.raises(IndexError):
        t.gather(np.array([1000]))
    t.close()


def test_a_file_of_the_wrong_size_is_refused_with_the_right_size(table):
    path, _ = table
    with pytest.raises(FlashnextError, match=r"is 320,000 bytes; this model's PLE table is 320,320 \(1,001 rows"):
        PleTableFile(path, 1001, 320)
    with pytest.raises(FlashnextError, match="no such file"):
        PleTableFile(path.with_name("missing.bin"), 1000, 320)


def test_decode_advice_only_for_small_steps(table, monkeypatch):
    path, _ = table
    t = PleTableFile(path, 1000, 320)
    assert t.advise_step(np.arange(16).reshape(1, 16))
    assert not t.advise_step(np.zeros(DECODE_ADVICE_MAX_ROWS + 1, dtype=np.int64))
    t.close()
    monkeypatch.setenv("VLLM_PLE_DECODE_ADVICE", "0")
    off = PleTableFile(path, 1000, 320)
    assert not off.advise_step(np.arange(16))
    off.close()
