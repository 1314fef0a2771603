"""The library half of patches ple-mmap and decode-06: the table file as the serving patch opens it,
and which steps the host hashes."""

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


def test_the_host_hashes_a_step_only_when_it_holds_every_token():
    """``PleFileServing.host_ids`` declines (vLLM's kernel then gives the ids) a step with a token
    the host does not have; that it hashes the others as vLLM's kernel does is the runner test's
    (tests/serving/test_patch_series.py). The batch here holds only the InputBatch fields it reads."""
    from types import SimpleNamespace

    from flashnext.serving.hooks.ple_file import PleFileServing

    serving = PleFileServing(owners=[])
    serving.add_request("a", list(range(100)), num_computed_tokens=0)

    def batch(start, count, drafts=0, padded=0, req="a"):
        return SimpleNamespace(req_ids=[req], num_reqs=1, num_draft_tokens=drafts, num_tokens=count,
                               num_tokens_after_padding=count + padded,
                               num_computed_tokens_np=np.array([start]), num_scheduled_tokens=np.array([count]),
                               query_start_loc_np=np.array([0, count]))

    assert serving.host_ids(batch(100, 1)) is None  # a decode row: its token was sampled on the device
    assert serving.host_ids(batch(96, 8)) is None  # past the prefill tokens
    assert serving.host_ids(batch(0, 8, drafts=1)) is None  # MTP drafts
    assert serving.host_ids(batch(0, 8, padded=8)) is None  # padded to a captured graph's size
    assert serving.host_ids(batch(0, 8, req="b")) is None  # a request it was not given
    serving.remove_request("a")
    assert serving.host_ids(batch(0, 8)) is None
