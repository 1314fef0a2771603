"""``ple build --format nvfp4|fp8`` resumes: interrupted after k chunks (an exception at the k-th
checkpoint, or a SIGKILL), the next run checks what it found (the first pass read again, the chunks
done decoded from their bytes), quantizes only the chunks not done, and makes the overlay and report
of an uninterrupted build, byte for byte. A resume continues only the same source, kind and chunking,
in the very partial the build made, from a journal whose every piece and value checks out; otherwise
it starts over with one line saying why, removing only what flashnext made. (What a changed journal
or partial shard does is ``tests/hostile/test_hostile_resume.py``'s.)"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import flashnext.quant.overlays.ple_quant as pq
from flashnext.errors import FlashnextError
from flashnext.quant.formats.safetensors_io import read_header
from flashnext.quant.overlays.ple_quant import PleQuantize, quantize_ple_table
from support.hostile import tree_state

# 4 shards of 4224 rows: 3 chunks each, 12 a pass; a checkpoint after each chunk of the quantize pass
CHUNK_ROWS = 2048
CHUNKS = 12


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(pq, "CHUNK_ROWS", CHUNK_ROWS)


@pytest.fixture(scope="module")
def straight(demo_snapshot, tmp_path_factory):
    """Uninterrupted builds of each format (with the same chunking), and their reports."""
    root = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pq, "CHUNK_ROWS", CHUNK_ROWS)
        return {fmt: (root / fmt, quantize_ple_table(demo_snapshot, root / fmt, fmt, progress=False))
                for fmt in ("nvfp4", "fp8")}


def interrupt_at(monkeypatch, k: int, error: type[BaseException] = KeyboardInterrupt) -> None:
    """Raise ``error`` just after the k-th checkpoint (its journal written): k units are recorded."""
    real = PleQuantize.checkpoint
    count = [0]

    def checkpoint(self):
        real(self)
        count[0] += 1
        if count[0] == k:
            raise error()

    monkeypatch.setattr(PleQuantize, "checkpoint", checkpoint)


def interrupt_at_read(monkeypatch, k: int) -> None:
    """Ctrl-C as the k-th chunk is read (from the first pass on)."""
    real, count = pq.read_rows, [0]

    def read_rows(*a):
        count[0] += 1
        if count[0] == k:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(pq, "read_rows", read_rows)


def count_reads(monkeypatch) -> list:
    reads = []
    real = pq.read_rows

    def read_rows(path, entry, start, stop):
        reads.append((entry.name, start))
        return real(path, entry, start, stop)

    monkeypatch.setattr(pq, "read_rows", read_rows)
    return reads


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def interrupted(snapshot, out: Path, fmt: str, k: int) -> None:
    with pytest.MonkeyPatch.context() as m:
        interrupt_at(m, k)
        with pytest.raises(KeyboardInterrupt):
            quantize_ple_table(snapshot, out, fmt, progress=False)
    assert not out.exists()  # nothing half-written at OUT
    assert (out.parent / f".{out.name}.partial").is_dir() and (out.parent / f".{out.name}.partial.json").is_file()


def build(snapshot, out: Path, fmt: str, **kwargs) -> tuple[dict, list[str]]:
    lines: list[str] = []
    report = PleQuantize(pq.Snapshot.open(snapshot), fmt).build(out, progress=False, notice=lines.append, **kwargs)
    return report, lines


def assert_as_straight(out: Path, report: dict, straight_build) -> None:
    overlay, expected = straight_build
    assert files(out) == files(overlay)
    assert report == expected  # the error sums were restored, not restarted
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


class Bars:
    """Every progress bar a build makes: (total, initial) of each."""

    def __init__(self, monkeypatch):
        self.made = []
        made = self.made

        class Bar(pq.Progress):
            def __init__(self, total, enabled, desc, unit="B", initial=0):
                made.append((total, initial))
                super().__init__(total, False, desc, unit, initial)

        monkeypatch.setattr(pq, "Progress", Bar)


@pytest.mark.parametrize("fmt, k", [("nvfp4", 5), ("nvfp4", CHUNKS), ("fp8", 1)],
                         ids=["in-the-quantize-pass", "after-the-last-chunk", "fp8"])
def test_an_interrupted_build_resumes_where_it_stopped(fmt, k, demo_snapshot, straight, tmp_path, monkeypatch):
    out = tmp_path / "o"
    interrupted(demo_snapshot, out, fmt, k)
    reads = count_reads(monkeypatch)
    bars = Bars(monkeypatch)
    report, lines = build(demo_snapshot, out, fmt)
    assert lines == [f"resuming the interrupted build in {tmp_path / '.o.partial'}"]
    # The first pass again (it checks the journal), then only the chunks not yet quantized.
    assert len(reads) == CHUNKS + (CHUNKS - k)
    source = pq.find_ple_source(pq.Snapshot.open(demo_snapshot))
    table = pq._bytes_of_chunks(source, CHUNKS)
    (checked, _), (total, initial) = bars.made  # the build's bar starts at the work done before
    assert checked == table and total == 2 * table
    assert initial == table + pq._bytes_of_chunks(source, k)
    assert_as_straight(out, report, straight[fmt])


def test_a_build_interrupted_in_its_first_pass(demo_snapshot, straight, tmp_path):
    """The first pass writes nothing a resume could check: the resumed build does it again."""
    out = tmp_path / "o"
    with pytest.MonkeyPatch.context() as m:
        interrupt_at_read(m, 5)
        with pytest.raises(KeyboardInterrupt):
            quantize_ple_table(demo_snapshot, out, "nvfp4", progress=False)
    with pytest.MonkeyPatch.context() as m:
        reads = count_reads(m)
        report, lines = build(demo_snapshot, out, "nvfp4")
    assert lines[0].startswith("resuming") and len(reads) == 2 * CHUNKS
    assert_as_straight(out, report, straight["nvfp4"])


def test_a_build_interrupted_twice(demo_snapshot, straight, tmp_path):
    out = tmp_path / "o"
    interrupted(demo_snapshot, out, "nvfp4", 3)
    interrupted(demo_snapshot, out, "nvfp4", 6)  # counted from the resume: chunk 9
    report, _ = build(demo_snapshot, out, "nvfp4")
    assert_as_straight(out, report, straight["nvfp4"])


KILLED = """
import os, signal, sys
sys.path[:0] = [sys.argv[4]]
import flashnext.quant.overlays.ple_quant as pq
pq.CHUNK_ROWS = int(sys.argv[3])
real, count = pq.PleQuantize.checkpoint, [0]
def checkpoint(self):
    real(self)
    count[0] += 1
    if count[0] == 9:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind runs
pq.PleQuantize.checkpoint = checkpoint
pq.quantize_ple_table(sys.argv[1], sys.argv[2], "fp8", progress=False)
"""


def test_a_killed_build_resumes(demo_snapshot, straight, tmp_path):
    out = tmp_path / "o"
    killed = subprocess.run([sys.executable, "-c", KILLED, str(demo_snapshot), str(out), str(CHUNK_ROWS),
                             str(Path(__file__).parents[2])], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()
    report, lines = build(demo_snapshot, out, "fp8")
    assert lines[0].startswith("resuming")
    assert_as_straight(out, report, straight["fp8"])


# --- when a resume starts over ------------------------------------------------------------------

def swap_for_a_copy(partial: Path, snapshot: Path) -> None:
    copy = partial.with_name("copy")
    shutil.copytree(partial, copy)  # the marker and the shards, byte for byte: another inode
    shutil.rmtree(partial)
    copy.rename(partial)


def link_into_the_snapshot(partial: Path, snapshot: Path) -> None:
    shutil.rmtree(partial)
    partial.symlink_to(snapshot, target_is_directory=True)


def damage_the_journal(partial: Path, snapshot: Path) -> None:
    journal = partial.with_name(partial.name + ".json")
    journal.write_text(journal.read_text()[:-20])


def drop_the_partial(partial: Path, snapshot: Path) -> None:
    shutil.rmtree(partial)


def edit_the_journal(edit):
    def change(partial: Path, snapshot: Path) -> None:
        journal = partial.with_name(partial.name + ".json")
        data = json.loads(journal.read_text())
        edit(data)
        journal.write_text(json.dumps(data))
    return change


def each_table(edit):
    return edit_the_journal(lambda journal: [edit(p) for p in journal["state"].values()])


def a_shard_it_does_not_write(journal: dict) -> None:
    journal["written"]["model-00001-of-00005.safetensors"] = []


STARTS_OVER = {
    "another-partial": (swap_for_a_copy, "is not the directory that build made"),
    "a-link": (link_into_the_snapshot, "is not the directory that build made"),
    "damaged-journal": (damage_the_journal, "its journal is unreadable"),
    "no-partial": (drop_the_partial, "is not the directory that build made"),
    "older-journal": (edit_the_journal(lambda j: j.update(format="flashnext.overlay-journal/1")),
                      "not a flashnext.overlay-journal/2 journal"),
    "another-shard": (edit_the_journal(a_shard_it_does_not_write),
                      "records writes into model-00001-of-00005.safetensors, which this build does not write"),
    "chunks-past-the-end": (each_table(lambda p: p.update(chunks=CHUNKS + 1)), "does not fit its 12 chunks"),
    "chunks-without-maximum": (each_table(lambda p: p.update(amax=None)), "does not fit its 12 chunks"),
    "a-piece-dropped": (edit_the_journal(lambda j: [pieces.pop() for pieces in j["written"].values()]),
                        "records no bytes of chunk 3"),
    # It would stand for no bytes, in place of the piece it lies in.
    "an-empty-piece": (edit_the_journal(lambda j: [pieces.append(dict(pieces[0], offset=8, length=0))
                                                   for pieces in j["written"].values()]), "length must be more than 0"),
}


@pytest.mark.parametrize("case", list(STARTS_OVER))
def test_a_resume_starts_over_when_the_partial_is_not_the_one_it_made(case, demo_snapshot, straight, tmp_path):
    change, why = STARTS_OVER[case]
    out, partial = tmp_path / "o", tmp_path / ".o.partial"
    interrupted(demo_snapshot, out, "fp8", 4)
    snapshot = tree_state(demo_snapshot)
    change(partial, demo_snapshot)
    report, lines = build(demo_snapshot, out, "fp8")
    assert len(lines) == 1 and lines[0].startswith("starting over: ") and why in lines[0], lines
    assert_as_straight(out, report, straight["fp8"])
    assert tree_state(demo_snapshot) == snapshot  # a link is removed, never what it points at


def test_what_a_resume_still_trusts(demo_snapshot, straight, tmp_path):
    """Bytes rewritten together with their digest in the journal are resumed into: the journal is
    the build's own record, not a signature. The report then states the error of the bytes the
    overlay holds, as it recomputes that from them."""
    out, partial = tmp_path / "o", tmp_path / ".o.partial"
    interrupted(demo_snapshot, out, "fp8", 4)
    journal_path = tmp_path / ".o.partial.json"
    journal = json.loads(journal_path.read_text())
    (filename, pieces), = journal["written"].items()
    source = pq.find_ple_source(pq.Snapshot.open(demo_snapshot))
    piece = next(p for p in pieces if p["tensor"] == source.shards[0].name)
    path = partial / filename
    begin = read_header(path).entries[piece["tensor"]].begin + piece["offset"]
    forged = bytes(piece["length"])
    with open(path, "r+b") as f:
        f.seek(begin)
        f.write(forged)
    piece["sha256"] = hashlib.sha256(forged).hexdigest()
    journal_path.write_text(json.dumps(journal))
    report, lines = build(demo_snapshot, out, "fp8")
    assert lines[0].startswith("resuming")
    _, expected = straight["fp8"]
    assert report["tables"][0]["relative_mse"] > expected["tables"][0]["relative_mse"]


def test_a_resume_starts_over_for_another_format(demo_snapshot, straight, tmp_path):
    out = tmp_path / "o"
    interrupted(demo_snapshot, out, "nvfp4", 4)
    report, lines = build(demo_snapshot, out, "fp8")
    assert len(lines) == 1 and "built from another overlay kind" in lines[0], lines
    assert_as_straight(out, report, straight["fp8"])


def test_a_resume_starts_over_for_another_chunking(demo_snapshot, straight, tmp_path, monkeypatch):
    out = tmp_path / "o"
    interrupted(demo_snapshot, out, "fp8", 4)
    monkeypatch.setattr(pq, "CHUNK_ROWS", 1024)
    _, lines = build(demo_snapshot, out, "fp8")
    assert len(lines) == 1 and "built from another chunking" in lines[0], lines


def test_a_resume_starts_over_when_the_source_changed(snapshot_copy, tmp_path):
    from support.shards import rewrite_shard

    out = tmp_path / "o"
    interrupted(snapshot_copy, out, "fp8", 2)
    source = pq.find_ple_source(pq.Snapshot.open(snapshot_copy))
    name = source.shards[1].name

    def edit(tensors):
        tensors[name] = tensors[name] * 2

    rewrite_shard(source.shards[1].path, edit)
    report, lines = build(snapshot_copy, out, "fp8")
    assert len(lines) == 1 and "built from another source snapshot" in lines[0], lines
    fresh, _ = build(snapshot_copy, tmp_path / "fresh", "fp8")
    assert files(out) == files(tmp_path / "fresh") and report == fresh


# --- what is not flashnext's, and refusals ------------------------------------------------------

def test_a_partial_without_its_journal_is_not_touched(demo_snapshot, tmp_path):
    mine = tmp_path / ".o.partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(FlashnextError, match="is no interrupted flashnext build"):
        build(demo_snapshot, tmp_path / "o", "fp8")
    assert (mine / "notes.txt").read_text() == "mine" and not (tmp_path / "o").exists()


def test_a_partial_that_is_not_flashnexts_is_never_removed(demo_snapshot, tmp_path):
    out, partial = tmp_path / "o", tmp_path / ".o.partial"
    interrupted(demo_snapshot, out, "fp8", 4)
    shutil.rmtree(partial)
    partial.mkdir()  # someone's own folder at that name, no marker: not removed, even to start over
    (partial / "notes.txt").write_text("mine")
    with pytest.raises(FlashnextError, match="not a partial overlay flashnext made"):
        build(demo_snapshot, out, "fp8")
    assert (partial / "notes.txt").read_text() == "mine" and not out.exists()


def test_an_existing_output_is_refused_and_the_partial_kept(demo_snapshot, straight, tmp_path):
    out = tmp_path / "o"
    interrupted(demo_snapshot, out, "fp8", 4)
    shutil.copytree(straight["fp8"][0], out)
    before = tree_state(tmp_path)
    with pytest.raises(FlashnextError, match="already exists"):
        build(demo_snapshot, out, "fp8")
    assert tree_state(tmp_path) == before
    report, lines = build(demo_snapshot, out, "fp8", force=True)  # --force replaces it, resuming the partial
    assert lines[0].startswith("resuming")
    assert_as_straight(out, report, straight["fp8"])


def test_a_refusal_at_the_end_leaves_nothing(demo_snapshot, tmp_path, monkeypatch):
    """What would be refused when read back is never resumed into: the partial and journal go."""
    import flashnext.quant.overlays.builder as builder

    out = tmp_path / "o"
    interrupted(demo_snapshot, out, "fp8", 4)

    def refused(*a, **k):
        raise FlashnextError("refused when read back")

    monkeypatch.setattr(builder, "check_readable", refused)
    with pytest.raises(FlashnextError, match="refused when read back"):
        build(demo_snapshot, out, "fp8")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_crash_keeps_the_partial(demo_snapshot, tmp_path, monkeypatch, straight):
    """A crash (a bug, an out-of-memory) is no refusal: the work done is kept for the next run."""
    out = tmp_path / "o"
    with monkeypatch.context() as m:
        interrupt_at(m, 6, RuntimeError)
        with pytest.raises(RuntimeError):
            build(demo_snapshot, out, "fp8")
    journal = json.loads((tmp_path / ".o.partial.json").read_text())
    assert journal["state"][next(iter(journal["state"]))]["chunks"] == 6
    report, lines = build(demo_snapshot, out, "fp8")
    assert lines[0].startswith("resuming")
    assert_as_straight(out, report, straight["fp8"])
    assert os.listdir(tmp_path) == ["o"]
