"""Issue 42 item 2: a resume trusts nothing it did not check, in both resumable writers.

``ple build --format``: each case interrupts a build (as by Ctrl-C) after 3 of the 12 chunks of its
quantize pass, then changes what the interruption left: the journal (valid JSON, counts that fit) or
bytes of the partial shard (its size kept). The next run must start over, saying why in one line, and
make exactly the overlay and report of an uninterrupted build; never resume into what it cannot vouch
for, never exit 70. ``ple build`` (the BF16 table file): the same, interrupted before its third
shard, and it must make the very table the work tree's ``table.bin`` is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

import flashnext.quant.overlays.ple_quant as pq
from flashnext.quant.formats.safetensors_io import read_header
from flashnext.tools.cli import main as cli
from support.hostile import Work, interrupt_ple_build, ple_build

CHUNK_ROWS = 2048  # the demo's 4 shards of 4224 rows: 3 chunks each, 12 a pass
CHUNKS = 12
DONE = 3  # chunks of the quantize pass the interrupted build wrote


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(pq, "CHUNK_ROWS", CHUNK_ROWS)


def ple_format(w: Work, out: Path, fmt: str) -> list[str]:
    return ["ple", "build", "--src", str(w.snap), "--out", str(out), "--format", fmt, "--no-progress", "--json"]


def overlay_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def straight(pristine, tmp_path_factory):
    """Each format built without interruption (with the same chunking): its files and report."""
    root = tmp_path_factory.mktemp("straight")
    built = {}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pq, "CHUNK_ROWS", CHUNK_ROWS)
        for fmt in ("nvfp4", "fp8"):
            result = CliRunner().invoke(cli, ple_format(Work(pristine), root / fmt, fmt))
            assert result.exit_code == 0, result.output
            built[fmt] = (overlay_files(root / fmt), json.loads(result.stdout))
    return built


def interrupt(w: Work, out: Path, fmt: str, monkeypatch) -> None:
    """Ctrl-C as the quantize pass reads its chunk DONE + 1: chunks 0..DONE-1 are in the journal."""
    real, reads = pq.read_rows, [0]

    def read_rows(*a, **k):
        reads[0] += 1
        if reads[0] == CHUNKS + DONE + 1:
            raise KeyboardInterrupt
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(pq, "read_rows", read_rows)
        result = CliRunner().invoke(cli, ple_format(w, out, fmt))
    assert result.exit_code == 130, result.output
    assert (out.parent / f".{out.name}.partial.json").is_file()


def journal_states(edit: Callable[[dict], None]) -> Callable[[Work, Path], None]:
    """``edit`` applied to each table's progress in the journal."""
    def change(w: Work, out: Path) -> None:
        def each_table(journal):
            for progress in journal["state"].values():
                edit(progress)
        w.edit_json(out.parent / f".{out.name}.partial.json", each_table)
    return change


def partial_bytes(change_bytes: Callable[[bytes], bytes]) -> Callable[[Work, Path], None]:
    """``change_bytes`` applied to the first 4 KiB of the first table shard's weight in the partial
    (inside chunk 0, written and recorded), the file's size kept."""
    def change(w: Work, out: Path) -> None:
        source = pq.find_ple_source(pq.Snapshot.open(w.snap))
        shard = source.shards[0]
        path = out.parent / f".{out.name}.partial" / shard.path.name
        begin = read_header(path).entries[shard.name].begin
        with open(path, "r+b") as f:
            f.seek(begin)
            data = f.read(4096)
            f.seek(begin)
            f.write(change_bytes(data))
    return change


def flip_one_bit(data: bytes) -> bytes:
    return bytes([data[0] ^ 0x01]) + data[1:]


def zeroed(data: bytes) -> bytes:
    return bytes(len(data))


@dataclass(frozen=True)
class Resume:
    id: str
    fmt: str
    change: Callable[[Work, Path], None]


CASES = [
    # The running maximum gives the global scale of every chunk: written ones and those to come.
    Resume("edited-running-maximum", "fp8", journal_states(lambda p: p.update(amax=p["amax"] * 4))),
    Resume("running-maximum-one-ulp", "nvfp4",
           journal_states(lambda p: p.update(amax=math.nextafter(p["amax"], math.inf)))),
    # The run that found this read a relative squared error of 4.8e305 in its report.
    Resume("edited-error-sums", "nvfp4", journal_states(lambda p: p.setdefault("errors", {}).update(squared=1e300))),
    Resume("partial-bit-flipped", "fp8", partial_bytes(flip_one_bit)),
    Resume("partial-bytes-zeroed", "nvfp4", partial_bytes(zeroed)),
    # Ended in exit 70 ("tensors never written").
    Resume("journal-claims-every-chunk", "fp8", journal_states(lambda p: p.update(chunks=CHUNKS))),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_resume_checks_what_it_continues(case: Resume, work: Work, straight, monkeypatch):
    out = work.root / "ple-overlay"
    interrupt(work, out, case.fmt, monkeypatch)
    case.change(work, out)
    result = CliRunner().invoke(cli, ple_format(work, out, case.fmt))
    assert result.exit_code == 0, result.output
    files, report = straight[case.fmt]
    assert overlay_files(out) == files
    assert json.loads(result.stdout) == report
    notices = result.stderr.splitlines()
    assert len(notices) == 1 and notices[0].startswith("starting over: "), result.stderr
    assert not [p.name for p in work.root.iterdir() if p.name.startswith(f".{out.name}.")]


# --- the BF16 table file --------------------------------------------------------------------------

def table_journal(edit: Callable[[dict], None]) -> Callable[[Work], None]:
    """``edit`` applied to the shards the journal says the partial table holds."""
    return lambda w: w.edit_json(w.root / "new.bin.partial.json", lambda journal: edit(journal["shards"]))


def partial_table(change_bytes: Callable[[bytes], bytes]) -> Callable[[Work], None]:
    """``change_bytes`` applied to 4 KiB of the partial table inside its first shard, the size kept."""
    def change(w: Work) -> None:
        with open(w.root / "new.bin.partial", "r+b") as f:
            f.seek(8192)
            data = f.read(4096)
            f.seek(8192)
            f.write(change_bytes(data))
    return change


def claim_shard_2(shards: dict) -> None:
    shards["2"] = dict(shards["1"], index=2)


TABLE_CASES = {
    "table-partial-bit-flipped": partial_table(flip_one_bit),
    "table-partial-bytes-zeroed": partial_table(zeroed),
    "table-journal-block-hash": table_journal(lambda shards: shards["0"]["block_sha256"].__setitem__(0, "0" * 64)),
    "table-journal-claims-a-shard-not-copied": table_journal(claim_shard_2),
}


@pytest.mark.parametrize("case", list(TABLE_CASES))
def test_a_table_resume_checks_what_it_continues(case: str, work: Work, monkeypatch):
    interrupt_ple_build(work, monkeypatch, at_shard=2)
    TABLE_CASES[case](work)
    result = CliRunner().invoke(cli, ple_build(work))
    assert result.exit_code == 0, result.output
    assert (work.root / "new.bin").read_bytes() == work.table.read_bytes()
    verify = CliRunner().invoke(cli, ["ple", "verify", "--full", str(work.root / "new.bin")])
    assert verify.exit_code == 0, verify.output
    notices = result.stderr.splitlines()
    assert len(notices) == 1 and notices[0].startswith("starting over: "), result.stderr
    assert not [p.name for p in work.root.iterdir() if p.name.startswith("new.bin.partial")]
