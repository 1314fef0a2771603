"""Hostile and broken inputs, table-driven: every one ends in one line and a non-zero exit, writes
nothing (the whole work tree, source snapshot included, is byte-for-byte unchanged), and never
follows a path out of its root. The harness is ``tests/support/hostile.py``; each other module of
this folder is one class of attack.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashnext.quant.checkpoint.fsutil import output_lock
from flashnext.tools.cli import main as cli
from support.hostile import (
    interrupt_ple_build,
    assert_refused,
    Case,
    FIRST_SHARD,
    INDEX,
    MTP_SHARD,
    Whole,
    Work,
    adds,
    apply,
    config_case,
    duplicate_tensor_names,
    header_case,
    header_not_an_object,
    huge_header_length,
    invoke_expecting_one_line,
    manifest_case,
    modes_bind,
    mtp,
    negative_offset,
    non_string_metadata,
    overlapping_offsets,
    ple_build,
    ple_verify,
    repack,
    reversed_offsets,
    shape_disagrees_with_bytes,
    shard_name,
    sidecar_case,
    text,
    trailing_bytes,
    tree_state,
    truncated,
    unknown_dtype,
    unrelated_folder,
    view_record_case,
)


def a_file(w: Work) -> Path:
    """A regular file of the user's, where a command line names a folder."""
    path = w.root / "notes.txt"
    path.write_text("mine")
    return path


REV = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(w: Work, *inside: str) -> Path:
    """A Hugging Face hub cache under the work tree, laid out as huggingface_hub lays one out (one
    repository: its blobs, refs and one snapshot); the path ``inside`` its repository folder."""
    repo = w.root / "hf" / "hub" / "models--org--name"
    for folder in ("blobs", "refs", f"snapshots/{REV}"):
        (repo / folder).mkdir(parents=True, exist_ok=True)
    return repo.joinpath(*inside)


def snapshot_at_out(w: Work) -> None:
    """A second demo snapshot (demo-checkpoint's output, its marker included) where ``--out`` is."""
    shutil.copytree(w.snap, w.root / "out", symlinks=True)


CASES = [
    # Shard names from the index are output paths: they must stay inside the snapshot.
    Case("index-absolute-shard", shard_name("/tmp/flashnext-hostile.safetensors"), "does not stay inside"),
    Case("index-dotdot-shard", shard_name("../ov/" + MTP_SHARD), "does not stay inside"),
    Case("index-not-safetensors", shard_name("config.json"), "is not a .safetensors file name"),
    Case("index-dotdot-repack", lambda w: (shard_name("../elsewhere.safetensors")(w), repack(w))[1],
         "does not stay inside"),
    # Manifest paths are untrusted too.
    Case("manifest-adds-dotdot-verify", manifest_case(adds("../x"), lambda w: ["overlay", "verify", str(w.ov),
                                                                            "--base", str(w.snap)]),
         "does not stay inside"),
    Case("manifest-adds-dotdot-apply", manifest_case(adds("../x"), apply), "does not stay inside"),
    Case("manifest-adds-absolute-no-verify", manifest_case(adds("/etc/passwd"), lambda w: apply(w, "--no-verify")),
         "does not stay inside"),
    Case("manifest-replaces-dotdot", manifest_case(
        lambda m: m["replaces"][0].update(path="../snap/config.json"), apply), "does not stay inside"),
    Case("manifest-names-its-own-file", manifest_case(adds("overlay.json"), apply), "flashnext's own file"),
    Case("manifest-duplicate-path", manifest_case(lambda m: m["replaces"].append(m["replaces"][0]), apply),
         "listed twice"),
    Case("manifest-wrong-type", manifest_case(lambda m: m.update(replaces={}), apply), "replaces"),
    Case("manifest-missing-key", manifest_case(lambda m: m.pop("kind"), apply), "kind"),
    Case("manifest-size-not-int", manifest_case(lambda m: m["replaces"][0].update(size="12"), apply), "size"),
    Case("manifest-unknown-key", manifest_case(lambda m: m.update(extra=1), apply), "extra"),
    Case("manifest-not-object", manifest_case(lambda m: Whole([1]), apply), "must be a JSON object"),
    Case("manifest-not-json", lambda w: ((w.ov / "overlay.json").write_text("{"), apply(w))[1], "not valid JSON"),
    Case("manifest-schema-version", manifest_case(lambda m: m.update(schema_version=2), apply), "schema_version"),
    # --force never removes what flashnext did not make, nor an input.
    Case("apply-out-is-base", lambda w: apply(w, "--force", out=w.snap), "is the base snapshot itself"),
    Case("apply-out-parent-of-base", lambda w: apply(w, "--force", out=w.root), "contains the base snapshot"),
    Case("apply-out-is-overlay", lambda w: apply(w, "--force", out=w.ov), "is the overlay"),
    Case("apply-out-inside-overlay", lambda w: apply(w, out=w.ov / "view"), "lies inside the overlay"),
    Case("mtp-out-parent-of-src", lambda w: ["make-mtp-int4", "--src", str(w.snap), "--out", str(w.root),
                                            "--force", "--no-progress"], "contains the source snapshot"),
    Case("mtp-out-inside-src", lambda w: ["make-mtp-int4", "--src", str(w.snap), "--out", str(w.snap / "o"),
                                         "--no-progress"], "lies inside the source snapshot"),
    Case("mtp-force-unrelated", lambda w: ["make-mtp-int4", "--src", str(w.snap), "--out",
                                          str(unrelated_folder(w)), "--force", "--no-progress"],
         "was not made by flashnext"),
    Case("repack-out-is-src", lambda w: ["repack-int6", "--src", str(w.snap), "--out", str(w.snap), "--force"],
         "is the source snapshot itself"),
    Case("demo-force-unrelated", lambda w: ["demo-checkpoint", "--out", str(unrelated_folder(w)), "--force"],
         "was not made by flashnext"),
    Case("demo-force-file", lambda w: ["demo-checkpoint", "--out", str(w.snap / "README.md"), "--force"],
         "was not made by flashnext"),
    Case("apply-force-unrelated", lambda w: apply(w, "--force", out=unrelated_folder(w)), "was not made by flashnext"),
    # --force replaces only its own command's output, not another command's (issue 44): the work
    # tree's snapshot is demo-checkpoint's, its overlay make-mtp-int4's.
    Case("selftest-force-snapshot", lambda w: ["selftest", "--out", str(w.snap), "--force", "--gpus", "0"],
         "was made by 'demo-checkpoint', not by flashnext selftest; --force only replaces"),
    Case("demo-force-overlay", lambda w: ["demo-checkpoint", "--out", str(w.ov), "--force"],
         "was made by 'make-mtp-int4', not by demo-checkpoint"),
    Case("mtp-force-demo-snapshot", lambda w: (snapshot_at_out(w), mtp(w, "--force"))[1],
         "was made by 'demo-checkpoint', not by make-mtp-int4"),
    Case("apply-force-demo-snapshot", lambda w: (snapshot_at_out(w), apply(w, "--force"))[1],
         "was made by 'demo-checkpoint', not by overlay apply"),
    Case("repack-force-demo-snapshot", lambda w: (snapshot_at_out(w), repack(w, "--force", "--no-progress"))[1],
         "was made by 'demo-checkpoint', not by repack-int6"),
    Case("ple-build-over-a-source-shard", lambda w: ["ple", "build", "--src", str(w.snap), "--out",
                                                    str(w.snap / FIRST_SHARD), "--force", "--no-progress"],
         "lies inside the source snapshot"),
    Case("ple-build-force-unrelated-file", lambda w: ((w.root / "notes.bin").write_bytes(b"mine"),
                                                      ["ple", "build", "--src", str(w.snap), "--out",
                                                       str(w.root / "notes.bin"), "--force", "--no-progress"])[1],
         "was not made by `flashnext ple build`"),
    Case("ple-build-foreign-partial", lambda w: ((w.root / "new.bin.partial").write_bytes(b"mine"), ple_build(w))[1],
         "no interrupted flashnext build"),
    Case("report-over-source-config", lambda w: mtp(w, "--report", str(w.snap / "config.json")),
         "lies inside the source snapshot"),
    Case("report-over-unrelated-file", lambda w: ((w.root / "notes.json").write_text("{}"),
                                                  mtp(w, "--report", str(w.root / "notes.json")))[1],
         "is not a make-mtp-int4 report"),
    # Where --report goes is checked before the build, not after minutes of it (issue 42).
    Case("report-folder-is-a-file", lambda w: mtp(w, "--report", str(a_file(w) / "report.json")),
         "cannot be written: cannot open the directory"),
    Case("report-folders-under-a-file", lambda w: mtp(w, "--report", str(a_file(w) / "new" / "report.json")),
         "cannot be written: cannot open the directory"),
    Case("report-folder-a-dangling-link", lambda w: (os.symlink(w.root / "nowhere", w.root / "gone"),
                                                     mtp(w, "--report", str(w.root / "gone" / "report.json")))[1],
         "cannot be written: cannot open the directory"),
    # No output goes into what huggingface_hub alone writes in its cache (issue 42).
    Case("mtp-out-in-a-hub-snapshot", lambda w: ["make-mtp-int4", "--src", str(w.snap), "--out",
                                                 str(hub_cache(w, "snapshots", REV, "mtp-int4")), "--no-progress"],
         "lies inside the Hugging Face cache's models--org--name/snapshots"),
    Case("mtp-out-a-new-hub-revision", lambda w: ["make-mtp-int4", "--src", str(w.snap), "--out",
                                                  str(hub_cache(w, "snapshots", "f" * 40)), "--no-progress"],
         "lies inside the Hugging Face cache's models--org--name/snapshots"),
    Case("mtp-out-through-a-link-into-a-hub-snapshot",
         lambda w: (os.symlink(hub_cache(w, "snapshots", REV), w.root / "model"),
                    ["make-mtp-int4", "--src", str(w.snap), "--out", str(w.root / "model" / "mtp-int4"),
                     "--no-progress"])[1],
         "lies inside the Hugging Face cache's models--org--name/snapshots"),
    Case("repack-out-in-hub-blobs", lambda w: ["repack-int6", "--src", str(w.snap), "--out",
                                               str(hub_cache(w, "blobs", "int6"))],
         "lies inside the Hugging Face cache's models--org--name/blobs"),
    Case("apply-out-in-a-hub-snapshot", lambda w: apply(w, out=hub_cache(w, "snapshots", REV, "view")),
         "lies inside the Hugging Face cache's models--org--name/snapshots"),
    Case("ple-build-out-in-a-hub-snapshot", lambda w: ["ple", "build", "--src", str(w.snap), "--out",
                                                       str(hub_cache(w, "snapshots", REV, "table.bin")),
                                                       "--no-progress"],
         "lies inside the Hugging Face cache's models--org--name/snapshots"),
    Case("demo-out-in-hub-refs", lambda w: ["demo-checkpoint", "--out", str(hub_cache(w, "refs", "demo"))],
         "lies inside the Hugging Face cache's models--org--name/refs"),
    Case("report-in-a-hub-snapshot", lambda w: mtp(w, "--report", str(hub_cache(w, "snapshots", REV, "r.json"))),
         "lies inside the Hugging Face cache's models--org--name/snapshots"),
    # Shard headers are checked as the safetensors library checks them.
    Case("header-negative-offset", header_case(negative_offset), "data_offsets"),
    Case("header-reversed-offsets", header_case(reversed_offsets), "data_offsets"),
    Case("header-overlapping-offsets", header_case(overlapping_offsets), "no gap or overlap"),
    Case("header-duplicate-names", header_case(duplicate_tensor_names), "appears twice"),
    Case("header-non-string-metadata", header_case(non_string_metadata), "__metadata__"),
    Case("header-unknown-dtype", header_case(unknown_dtype), "unsupported dtype"),
    Case("header-shape-vs-bytes", header_case(shape_disagrees_with_bytes), "data_offsets span"),
    Case("header-not-object", header_case(header_not_an_object), "does not start with"),
    Case("header-trailing-bytes", header_case(trailing_bytes), "trailing bytes"),
    Case("header-truncated", header_case(truncated), "truncated"),
    Case("header-huge-length", header_case(huge_header_length), "implausible"),
    Case("header-broken-repack", header_case(overlapping_offsets, FIRST_SHARD, repack), "no gap or overlap"),
    Case("header-broken-apply", header_case(negative_offset, command=apply), "does not fit"),
    # Index and config: wrong JSON types and missing keys.
    Case("index-not-object", config_case(lambda i: Whole([]), file=INDEX), "must be a JSON object"),
    Case("index-no-weight-map", config_case(lambda i: Whole({"metadata": {}}), file=INDEX), "weight_map is missing"),
    Case("index-weight-map-list", config_case(lambda i: i.update(weight_map=[1]), file=INDEX), "weight_map"),
    Case("index-shard-not-string", config_case(lambda i: i["weight_map"].update(x=5), file=INDEX),
         "is not a .safetensors file name"),
    Case("config-not-object", config_case(lambda c: Whole("x")), "must be a JSON object"),
    Case("config-text-config-string", config_case(lambda c: c.update(text_config="x")), "text_config"),
    Case("config-num-experts-string", config_case(text("num_experts", "8")), "num_experts must be an integer"),
    Case("config-num-experts-zero", config_case(text("num_experts", 0)), "num_experts must be at least 1"),
    Case("config-hidden-missing", config_case(lambda c: c["text_config"].pop("hidden_size")), "hidden_size"),
    Case("config-qc-groups-list", config_case(lambda c: c["quantization_config"].update(config_groups=[1])),
         "config_groups"),
    Case("config-qc-ignore-string", config_case(lambda c: c["quantization_config"].update(ignore="mtp")), "ignore"),
    Case("config-bitplane-modules-string", config_case(lambda c: c.update(flashnext={"int6_bitplane": {
        "layout": "flashnext.bitplane6/1", "modules": "x"}}), command=repack), "modules must be a list"),
    # The PLE config: zero divisors and nonsense values.
    Case("ple-divisor-zero", config_case(text("make_ngram_vocab_size_divisible_by", 0), command=ple_build),
         "at least 1"),
    Case("ple-heads-zero", config_case(text("heads_per_ngram", 0), command=ple_build), "at least 1"),
    Case("ple-split-parts-zero", config_case(text("split_ngram_parts", 0), command=ple_build), "at least 1"),
    Case("ple-ngram-size-string", config_case(text("ngram_size", "3"), command=ple_build), "must be an integer"),
    Case("ple-layer-ids-string", config_case(text("ple_layer_ids", "2"), command=ple_build), "ple_layer_ids"),
    Case("ple-ids-divisor-zero", config_case(text("make_ngram_vocab_size_divisible_by", 0),
                                             command=lambda w: ["ple", "ids", "--config", str(w.snap / "config.json"),
                                                                "--tokens", "1,2"]), "at least 1"),
    Case("ple-ids-huge-token", lambda w: ["ple", "ids", "--config", str(w.snap / "config.json"),
                                          "--tokens", str(10**30)], "outside the vocabulary"),
    Case("ple-ids-negative-token", lambda w: ["ple", "ids", "--config", str(w.snap / "config.json"),
                                              "--tokens", "-1"], "outside the vocabulary"),
    Case("ple-ids-config-missing", lambda w: ["ple", "ids", "--config", str(w.root / "nope.json"), "--tokens", "1"],
         "missing"),
    # The PLE sidecar and the view record.
    Case("sidecar-not-object", sidecar_case(lambda s: Whole([]), ple_verify), "must be a JSON object"),
    Case("sidecar-rows-string", sidecar_case(lambda s: s.update(rows="3"), ple_verify), "rows"),
    Case("sidecar-missing-shards", sidecar_case(lambda s: s.pop("shards"), ple_verify), "shards"),
    Case("sidecar-bad-hash", sidecar_case(lambda s: s["shards"][0]["block_sha256"].__setitem__(0, "zz"), ple_verify),
         "block_sha256"),
    Case("sidecar-inconsistent", sidecar_case(lambda s: s.update(file_size=1), ple_verify), "file_size"),
    Case("view-record-overlays-string", view_record_case(lambda r: r.update(overlays="x")), "overlays"),
    Case("view-record-relative-base", view_record_case(lambda r: r.update(base="snap")), "not an absolute path"),
    Case("view-record-missing-base", view_record_case(lambda r: r.pop("base")), "base"),
    # Other arguments.
    Case("device-meta", lambda w: mtp(w, "--device", "meta"), "runs on cpu or cuda"),
    Case("device-nonsense", lambda w: mtp(w, "--device", "gpu7"), "not a device name"),
    Case("targets-bad-regex", lambda w: repack(w, "--targets", "("), "not a valid regular expression"),
    Case("src-is-a-file", lambda w: ["make-mtp-int4", "--src", str(w.snap / "config.json"), "--out",
                                     str(w.root / "out")], "not a directory"),
    Case("src-missing-shard", lambda w: ((w.snap / FIRST_SHARD).unlink(), mtp(w))[1], "is missing"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case: Case, work: Work):
    assert_refused(case, work)


def read_only_folder(w: Work) -> Path:
    folder = w.root / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder / "report.json"


# A folder no file can be created in, whoever runs the suite: root writes in a mode-555 folder, sysfs
# takes no new file from anyone.
REPORT_FOLDERS_WITHOUT_ROOM = [
    pytest.param(read_only_folder, "Permission denied", id="read-only-folder",
                 marks=pytest.mark.skipif(not modes_bind(), reason="root writes in a mode-555 folder")),
    pytest.param(lambda w: Path("/sys/flashnext-report.json"), "cannot create a file in /sys", id="sysfs",
                 marks=pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="no sysfs")),
]


@pytest.mark.parametrize("report, words", REPORT_FOLDERS_WITHOUT_ROOM)
def test_a_report_folder_that_takes_no_file_is_refused_before_the_build(report, words, work, monkeypatch):
    """Issue 42 item 6: --report into a folder that takes no new file failed only once the build was
    done (minutes on the real model); it is refused up front, the build never started."""
    import flashnext.quant.overlays.mtp_int4 as mod

    started = []
    monkeypatch.setattr(mod, "make_mtp_int4", lambda *a, **k: started.append(1))
    path = report(work)
    before = tree_state(work.root)
    result, line = invoke_expecting_one_line(mtp(work, "--report", str(path)))
    assert result.exit_code == 1 and line.startswith("Error: --report ") and words in line, line
    assert not started, "the build started"
    assert tree_state(work.root) == before and not path.exists()


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_the_configured_hub_cache_is_known_whatever_its_folders_are_called(variable, work, monkeypatch):
    """Issue 42 item 6: the cache huggingface_hub uses (HF_HUB_CACHE, else HF_HOME/hub) is known as
    one even where a repository folder is not named models--*."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv(variable, str(work.root / "hf"))
    cache = work.root / "hf" / ("hub" if variable == "HF_HOME" else "")
    (cache / "mirrored" / "snapshots" / REV).mkdir(parents=True)
    case = Case(f"{variable}-snapshot", lambda w: apply(w, out=cache / "mirrored" / "snapshots" / REV / "view"),
                "lies inside the Hugging Face cache's mirrored/snapshots")
    assert_refused(case, work)


def test_a_second_writer_is_refused(work):
    for argv, out in ((mtp(work), work.root / "out"), (ple_build(work), work.root / "new.bin"),
                      (apply(work), work.root / "out")):
        with output_lock(out):
            before = tree_state(work.root)
            result, line = invoke_expecting_one_line(argv)
            assert result.exit_code == 1 and "another flashnext process is writing" in line, line
            assert tree_state(work.root) == before


def test_leftovers_of_a_killed_writer_are_removed(work):
    out = work.root / "out"
    dead = work.root / ".out.partial-999999999"
    dead.mkdir()
    (dead / ".flashnext-output.json").write_text('{"made_by": "make-mtp-int4"}')
    (dead / MTP_SHARD).write_bytes(b"half")
    foreign = work.root / ".out.partial-123"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not flashnext's")
    assert CliRunner().invoke(cli, mtp(work)).exit_code == 0
    assert (out / "overlay.json").is_file()
    assert not dead.exists() and (foreign / "keep.txt").exists()
    assert not (work.root / ".out.lock").exists()


def test_force_replaces_flashnext_output_only(work):
    out = work.root / "out"
    for _ in range(2):
        result = CliRunner().invoke(cli, mtp(work, "--force"))
        assert result.exit_code == 0, result.output
    assert (out / ".flashnext-output.json").is_file()


def test_ple_resume_refuses_a_changed_source(work, monkeypatch):
    import flashnext.quant.ple.table as mod

    interrupt_ple_build(work, monkeypatch, at_shard=1)
    # Same names, dtypes, shapes and sizes; other bytes (as another revision of the checkpoint).
    source = mod.find_ple_source(mod.Snapshot.open(work.snap))
    shard = source.shards[0]
    with open(shard.path, "r+b") as f:
        f.seek(shard.entry.begin)
        data = f.read(shard.entry.nbytes)
        f.seek(shard.entry.begin)
        f.write(bytes(b ^ 0x5A for b in data))
    before = tree_state(work.root)
    result, line = invoke_expecting_one_line(ple_build(work))
    assert result.exit_code == 1 and "interrupted build from a different source" in line
    assert tree_state(work.root) == before
    result = CliRunner().invoke(cli, ple_build(work, "--force"))
    assert result.exit_code == 0, result.output
    assert CliRunner().invoke(cli, ["ple", "verify", "--full", str(work.root / "new.bin")]).exit_code == 0


def test_ple_free_space_counts_the_partial(work, monkeypatch):
    import flashnext.quant.ple.table as mod

    needed = []
    monkeypatch.setattr(mod, "check_free_space", lambda d, n, what: needed.append(n))
    interrupt_ple_build(work, monkeypatch, at_shard=2)
    assert CliRunner().invoke(cli, ple_build(work)).exit_code == 0
    full, resumed = needed
    assert resumed < full


def test_a_writer_killed_with_sigkill_leaves_nothing_for_long(work):
    """A real ``make-mtp-int4`` process killed (SIGKILL) while its partial output exists: the next
    run removes what it left and completes."""
    import signal
    import subprocess
    import sys
    import time

    out = work.root / "out"
    argv = [sys.executable, "-m", "flashnext", *mtp(work, "--experts-per-batch", "1")]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = None
    deadline = time.monotonic() + 120
    while partial is None and proc.poll() is None and time.monotonic() < deadline:
        partial = next((p for p in work.root.glob(".out.partial-*") if (p / MTP_SHARD).exists()), None)
        time.sleep(0.005)
    assert partial is not None, "the writer finished or failed before its partial output could be seen"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial.exists() and not out.exists()
    result = CliRunner().invoke(cli, mtp(work))
    assert result.exit_code == 0, result.output
    assert not partial.exists() and not list(work.root.glob(".out.*"))
    assert (out / "overlay.json").is_file()
