"""The prefetch planner, and the executor on a real file on this machine's disk."""

import logging
import os
import time

import numpy as np
import pytest

from flashnext.quant.demo import DEMO_TEXT_CONFIG
from flashnext.quant.ple.hashing import NgramHasher
from flashnext.quant.ple.layout import ple_layout
from flashnext.quant.ple.prefetch import (PAGE_SIZE, DecodeAdvisor, PromptPrefetcher, TableMapping, merge_pages,
                                          plan_prompt, row_pages)

ROW_BYTES = 320
CONFIG = dict(DEMO_TEXT_CONFIG, ngram_vocab_size_base=12_000, ple_embed_dim=2560)  # 160-element rows
HASHER = NgramHasher(ple_layout(CONFIG))


def test_pages_of_straddling_rows():
    # Row 12 covers bytes 3840..4159: the end of page 0 and the start of page 1.
    assert row_pages(np.array([12]), ROW_BYTES).tolist() == [0, 1]
    assert row_pages(np.array([0, 1, 2]), ROW_BYTES).tolist() == [0]
    ranges = merge_pages(np.array([3, 4, 5, 9, 11, 12]))
    assert ranges.first.tolist() == [3, 9, 11] and ranges.count.tolist() == [3, 1, 2]


def test_plan_matches_brute_force():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4096, 2500)
    plan = plan_prompt(HASHER, tokens, ROW_BYTES, window=1024)
    ids = HASHER.ids(tokens)
    assert len(plan) == 3
    for w, ranges in enumerate(plan):
        expected = set()
        for r in ids[w * 1024:(w + 1) * 1024].reshape(-1).tolist():
            expected.update(range(r * ROW_BYTES // PAGE_SIZE, (r * ROW_BYTES + ROW_BYTES - 1) // PAGE_SIZE + 1))
        got = set()
        for f, c in zip(ranges.first.tolist(), ranges.count.tolist()):
            got.update(range(f, f + c))
        assert got == expected


@pytest.fixture
def table(tmp_path):
    """A table file of the layout's size on the real disk, written, synced and evicted."""
    path = tmp_path / "table.bin"
    size = HASHER.layout.padded_rows * ROW_BYTES
    with open(path, "wb") as f:
        f.write(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    evict(path)
    return path


def evict(path):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def resident_pages(mapping: TableMapping) -> np.ndarray:
    import ctypes

    from flashnext.quant.ple.prefetch import _libc

    vec = np.zeros((mapping.size + PAGE_SIZE - 1) // PAGE_SIZE, dtype=np.uint8)
    assert _libc.mincore(mapping.address, mapping.size, vec.ctypes.data) == 0, ctypes.get_errno()
    return vec & 1


def wait_resident(mapping, pages, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if resident_pages(mapping)[pages].all():
            return True
        time.sleep(0.01)
    return False


def test_prompt_prefetch_brings_exactly_the_planned_pages(table):
    mapping = TableMapping(table, ROW_BYTES)
    try:
        before = resident_pages(mapping)
        if before.mean() > 0.2:
            pytest.skip("this filesystem ignores POSIX_FADV_DONTNEED; cannot start cold")
        tokens = np.random.default_rng(2).integers(0, 4096, 1500)
        pf = PromptPrefetcher(mapping, HASHER)
        pf.submit("r1", tokens)
        pf.drain()
        pf.stop()
        assert pf.windows_advised == 2
        wanted = row_pages(HASHER.ids(tokens), ROW_BYTES)
        assert wait_resident(mapping, wanted)
        # the gather that follows reads what the file holds
        rows = mapping.rows[HASHER.ids(tokens)[:3].reshape(-1)]
        with open(table, "rb") as f:
            f.seek(int(HASHER.ids(tokens)[0, 0]) * ROW_BYTES)
            assert rows[0].tobytes() == f.read(ROW_BYTES)
    finally:
        mapping.close()


def test_decode_advice_and_per_range_fallback(table, caplog):
    mapping = TableMapping(table, ROW_BYTES)
    try:
        advisor = DecodeAdvisor(mapping, HASHER)
        advisor.advise(123, (45, 67))
        assert wait_resident(mapping, row_pages(np.array(HASHER.token_ids(123, (45, 67))), ROW_BYTES))
        # The path taken when process_madvise is refused (EPERM in a container without
        # CAP_SYS_PTRACE, ENOSYS on old kernels): one madvise per range, logged once.
        TableMapping._warned = False
        mapping.batched = False
        with caplog.at_level(logging.WARNING):
            mapping._fallback(1)
            mapping._fallback(1)
        assert sum("per-range madvise" in r.message for r in caplog.records) == 1
        evict(table)
        advisor.advise(999, (1, 2))
        assert wait_resident(mapping, row_pages(np.array(HASHER.token_ids(999, (1, 2))), ROW_BYTES))
    finally:
        mapping.close()


def test_cancelled_request_is_dropped(table):
    mapping = TableMapping(table, ROW_BYTES)
    try:
        pf = PromptPrefetcher(mapping, HASHER)
        pf.cancel("r1")
        pf._jobs.put(("r1", np.arange(5000) % 4096, None))  # as if queued before the cancel landed
        pf.drain()
        assert pf.windows_advised == 0
        pf.stop()
    finally:
        mapping.close()


def test_switch_turns_it_off(table, monkeypatch):
    monkeypatch.setenv("VLLM_PLE_PREFETCH", "0")
    mapping = TableMapping(table, ROW_BYTES)
    try:
        pf = PromptPrefetcher(mapping, HASHER)
        pf.submit("r1", np.arange(100))
        assert not pf.enabled and pf.windows_advised == 0 and pf._jobs.empty()
    finally:
        mapping.close()


def test_residency_command(table):
    from click.testing import CliRunner

    from flashnext.tools.cli import main as cli

    result = CliRunner().invoke(cli, ["ple", "residency", str(table), "--json"])
    assert result.exit_code == 0, result.output
    import json

    info = json.loads(result.stdout)
    assert info["pages"] == (os.path.getsize(table) + PAGE_SIZE - 1) // PAGE_SIZE
    assert 0.0 <= info["fraction"] <= 1.0


def test_drive_check_command(table):
    from click.testing import CliRunner

    from flashnext.tools.cli import main as cli

    result = CliRunner().invoke(cli, ["ple", "drive-check", str(table), "--seconds", "1", "--json"])
    if "O_DIRECT" in result.output:
        pytest.skip("this filesystem does not support O_DIRECT")
    import json

    info = json.loads(result.stdout)
    assert info["qd1"]["reads"] > 0 and info["deep"]["iops"] > 0
    assert result.exit_code == (0 if info["ok"] else 4)


def test_a_slow_drive_has_an_exit_code_of_its_own(table, monkeypatch):
    """Issue 41: a drive too slow for the table exited 2, the code of a usage error."""
    from click.testing import CliRunner

    from flashnext.errors import EXIT_CODES, SlowDrive, UsageError
    from flashnext.quant.ple import drive
    from flashnext.tools.cli import main as cli

    monkeypatch.setattr(drive, "P99_LIMIT_MS", -1.0)  # every drive's tail is over it
    result = CliRunner().invoke(cli, ["ple", "drive-check", str(table), "--seconds", "1"])
    if "O_DIRECT" in result.output:
        pytest.skip("this filesystem does not support O_DIRECT")
    assert result.exit_code == EXIT_CODES[SlowDrive] == 4 != EXIT_CODES[UsageError], result.output
    assert result.stdout.splitlines()[-1].startswith("tail latency would stall decode")


def test_residency_of_an_empty_file_is_one_line(tmp_path):
    from click.testing import CliRunner

    from flashnext.tools.cli import main as cli

    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    result = CliRunner().invoke(cli, ["ple", "residency", str(empty)])
    assert result.exit_code == 1 and result.output.strip() == f"Error: {empty} is empty: not a PLE table"
