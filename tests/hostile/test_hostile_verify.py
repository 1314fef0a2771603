"""Issue 26, class 3: ``overlay verify VIEW`` checks every entry of the view against its record, in
both directions, and ``apply`` uses only the files an overlay's ``overlay.json`` lists and pins.

Each tampering of a view is one mismatch line and exit 3; each overlay that ships an unlisted index
or config.json is refused in one line with exit 1 and nothing written. No case writes anything but
what its setup did (the whole work tree is compared before and after the command).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from flashnext.quant.checkpoint.snapshot import Snapshot
from flashnext.quant.overlays.manifest import OverlayManifest
from flashnext.tools.cli import main as cli
from support.hostile import (
    assert_refused,
    FIRST_SHARD,
    INDEX,
    MTP_SHARD,
    Case,
    Work,
    apply,
    invoke_expecting_one_line,
    modes_bind,
)

CONFIG = "config.json"
OTHER_SHARD = "model-00002-of-00005.safetensors"
RECORD = ".flashnext-view.json"


def config_overlay(w: Work) -> Path:
    """A second overlay that changes one config.json value only, so that a view of ``ov`` and it
    has a merged config.json and index (real files) rather than links."""
    out = w.root / "ov2"
    out.mkdir()
    config = json.loads((w.snap / CONFIG).read_text())
    config["flashnext_test"] = 1
    (out / CONFIG).write_text(json.dumps(config))
    manifest = OverlayManifest.new("test-config", "test", Snapshot.open(w.snap).origin)
    manifest.replace(out, CONFIG, w.snap / CONFIG)
    manifest.write(out)
    return out


def make_view(w: Work, stacked: bool = False) -> Path:
    view = w.root / "view"
    argv = apply(w, out=view)
    if stacked:
        argv.insert(3, str(config_overlay(w)))
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    return view


def view_case(tamper: Callable[[Work, Path], None], stacked: bool = False) -> Callable[[Work], list[str]]:
    def setup(w: Work) -> list[str]:
        view = make_view(w, stacked)
        tamper(w, view)
        return ["overlay", "verify", str(view)]
    return setup


def relink(name: str, target: Callable[[Work], Path]) -> Callable[[Work, Path], None]:
    def tamper(w: Work, view: Path) -> None:
        (view / name).unlink()
        os.symlink(target(w), view / name)
    return tamper


def copy_over_link(name: str, source: Callable[[Work], Path]) -> Callable[[Work, Path], None]:
    """Replace the link ``name`` by a real file with ``source``'s bytes."""
    def tamper(w: Work, view: Path) -> None:
        data = source(w).read_bytes()
        (view / name).unlink()
        (view / name).write_bytes(data)
    return tamper


def remove(name: str) -> Callable[[Work, Path], None]:
    return lambda w, view: (view / name).unlink()


def edit_merged_config(w: Work, view: Path) -> None:
    config = json.loads((view / CONFIG).read_text())
    config["flashnext_test"] = 2
    (view / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def link_to_directory(w: Work, view: Path) -> None:
    (view / OTHER_SHARD).unlink()
    (view / OTHER_SHARD).mkdir()


def record_and_link_point_at_base(w: Work, view: Path) -> None:
    """The base's shard put back over the overlay's, and the record edited to agree."""
    relink(MTP_SHARD, lambda w: w.snap / MTP_SHARD)(w, view)
    w.edit_json(view / RECORD, lambda r: r["links"].update({MTP_SHARD: str(w.snap / MTP_SHARD)}))


def edited_overlay_config(w: Work) -> Path:
    path = w.root / "edited-config.json"
    config = json.loads((w.ov / CONFIG).read_text())
    config["flashnext_test"] = 3
    path.write_text(json.dumps(config))
    return path


MISMATCHES = [
    Case("link-replaced-by-a-copy-of-its-target",
         view_case(copy_over_link(OTHER_SHARD, lambda w: w.snap / OTHER_SHARD)),
         f"{OTHER_SHARD}: is a real file, not the link to", 3),
    Case("link-replaced-by-a-directory", view_case(link_to_directory), f"{OTHER_SHARD}: is a real directory", 3),
    Case("base-shard-linked-back-over-the-overlays", view_case(relink(MTP_SHARD, lambda w: w.snap / MTP_SHARD)),
         f"{MTP_SHARD}: links to ", 3),
    Case("base-shard-copied-back-over-the-overlays",
         view_case(copy_over_link(MTP_SHARD, lambda w: w.snap / MTP_SHARD)), f"{MTP_SHARD}: is a real file", 3),
    Case("base-shard-back-and-record-edited-to-match", view_case(record_and_link_point_at_base),
         f"{MTP_SHARD}: the view record links it to", 3),
    Case("base-config-linked-back-over-the-overlays", view_case(relink(CONFIG, lambda w: w.snap / CONFIG)),
         f"{CONFIG}: links to ", 3),
    Case("overlay-config-link-replaced-by-an-edited-file", view_case(copy_over_link(CONFIG, edited_overlay_config)),
         f"{CONFIG}: is a real file", 3),
    Case("entry-missing", view_case(remove(FIRST_SHARD)), f"{FIRST_SHARD}: missing from the view", 3),
    Case("merged-index-missing", view_case(remove(INDEX), stacked=True), f"{INDEX}: missing from the view", 3),
    Case("extra-file", view_case(lambda w, v: (v / "extra.safetensors").write_bytes(b"\0" * 8)),
         "extra.safetensors: not part of the view", 3),
    Case("extra-directory", view_case(lambda w, v: (v / "extra").mkdir()), "extra: not part of the view", 3),
    Case("merged-config-edited", view_case(edit_merged_config, stacked=True),
         f"{CONFIG}: changed since the view was made", 3),
    Case("merged-config-replaced-by-a-link-to-the-base", view_case(relink(CONFIG, lambda w: w.snap / CONFIG),
                                                                   stacked=True),
         f"{CONFIG}: is a link to", 3),
    Case("overlay-verify-sees-an-unlisted-config",
         lambda w: (unlist(CONFIG)(w), ["overlay", "verify", str(w.ov), "--base", str(w.snap)])[1],
         f"ov/{CONFIG}: in the overlay but not listed", 3),
]


@pytest.mark.parametrize("case", MISMATCHES, ids=[c.id for c in MISMATCHES])
def test_verify_finds_the_mismatch(case: Case, work: Work):
    assert_refused(case, work, first="mismatch: ")


# --- --full reads every base shard a view links, not only those the overlay replaces (issue 42) ------

def kept_shard(damage: Callable[[Path], None], of_view: bool = False,
               stacked: bool = False) -> Callable[[Work], list[str]]:
    """A base shard the overlay keeps (the view links it as it is) damaged, then ``verify --full`` of
    the overlay against the base, or of a view (of two overlays: ``stacked``) made before the damage."""
    def setup(w: Work) -> list[str]:
        view = make_view(w, stacked) if of_view else None
        damage(w.snap / OTHER_SHARD)
        target = [str(view)] if of_view else [str(w.ov), "--base", str(w.snap)]
        return ["overlay", "verify", *target, "--full", "--no-progress"]
    return setup


def to_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def to_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def truncated_under_its_header(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 8)


FULL_MISMATCHES = [
    Case("full-kept-shard-a-directory", kept_shard(to_directory), f"{OTHER_SHARD}: is a directory, not a safetensors",
         3),
    Case("full-kept-shard-a-fifo", kept_shard(to_fifo), f"{OTHER_SHARD}: is a FIFO, not a regular file", 3),
    Case("full-kept-shard-truncated", kept_shard(truncated_under_its_header),
         f"{OTHER_SHARD}: truncated: the header describes", 3),
    Case("full-kept-shard-missing", kept_shard(lambda p: p.unlink()), f"{OTHER_SHARD}: missing from the base snapshot",
         3),
    Case("full-view-kept-shard-truncated", kept_shard(truncated_under_its_header, of_view=True),
         f"{OTHER_SHARD}: truncated: the header describes", 3),
    Case("full-stacked-view-kept-shard-a-fifo", kept_shard(to_fifo, of_view=True, stacked=True),
         f"{OTHER_SHARD}: is a FIFO, not a regular file", 3),  # one line, not one per overlay
]


@pytest.mark.parametrize("case", FULL_MISMATCHES, ids=[c.id for c in FULL_MISMATCHES])
def test_verify_full_reads_every_kept_base_shard(case: Case, work: Work):
    """Issue 42 item 6: `overlay verify --full` said ok over a base shard it never opened (only those
    the overlay replaces were read); a view of it links that shard, which vLLM then fails to load."""
    assert_refused(case, work, first="mismatch: ")


@pytest.mark.skipif(not modes_bind(), reason="root reads a file whatever its mode")
def test_verify_full_on_an_unreadable_kept_shard_is_one_line(work: Work):
    (work.snap / OTHER_SHARD).chmod(0)
    result, line = invoke_expecting_one_line(["overlay", "verify", str(work.ov), "--base", str(work.snap), "--full",
                                              "--no-progress"])
    assert result.exit_code == 1 and line.startswith("Error: ") and "Permission denied" in line, line


def unlist(name: str) -> Callable[[Work], None]:
    """Drop ``name`` from the overlay's manifest; the file stays in the overlay, unpinned."""
    def edit(w: Work) -> None:
        w.edit_json(w.ov / "overlay.json",
                    lambda m: m.update(replaces=[e for e in m["replaces"] if e["path"] != name],
                                       adds=[e for e in m["adds"] if e["path"] != name]))
    return edit


def unlisted_apply(name: str, *extra: str) -> Callable[[Work], list[str]]:
    return lambda w: (unlist(name)(w), apply(w, *extra))[1]


def old_view_record(w: Work) -> list[str]:
    view = make_view(w)
    record = json.loads((view / RECORD).read_text())
    old = {"flashnext_view": 1, "builder_version": record["builder_version"], "base": record["base"],
           "overlays": record["overlays"]}
    (view / RECORD).write_text(json.dumps(old))
    return ["overlay", "verify", str(view)]


def record_link_outside(w: Work) -> list[str]:
    view = make_view(w)
    w.edit_json(view / RECORD, lambda r: r["links"].update({FIRST_SHARD: "/etc/passwd"}))
    return ["overlay", "verify", str(view)]


REFUSALS = [
    Case("apply-unlisted-config", unlisted_apply(CONFIG), f"ships {CONFIG}, which overlay.json does not list"),
    Case("apply-unlisted-index", unlisted_apply(INDEX), f"ships {INDEX}, which overlay.json does not list"),
    Case("apply-unlisted-config-no-verify", unlisted_apply(CONFIG, "--no-verify"),
         f"ships {CONFIG}, which overlay.json does not list"),
    Case("view-record-without-entries", old_view_record, "did not record what each entry must be"),
    Case("view-record-link-outside-its-roots", record_link_outside, "is not the base's or an overlay's"),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c.id for c in REFUSALS])
def test_refused_in_one_line(case: Case, work: Work):
    assert_refused(case, work)


def test_every_tampering_is_reported_one_line_each(work: Work):
    """Several tamperings at once: one line per mismatch, and none of them hides another."""
    view = make_view(work, stacked=True)
    remove(FIRST_SHARD)(work, view)
    relink(MTP_SHARD, lambda w: w.snap / MTP_SHARD)(work, view)
    edit_merged_config(work, view)
    (view / "extra.bin").write_bytes(b"x")
    result = CliRunner().invoke(cli, ["overlay", "verify", str(view), "--json"])
    assert result.exit_code == 3, result.output
    mismatches = json.loads(result.stdout)["mismatches"]
    assert sorted(m["path"] for m in mismatches) == sorted([FIRST_SHARD, MTP_SHARD, CONFIG, "extra.bin"])


def test_an_untouched_view_verifies(work: Work):
    for stacked in (False, True):
        view = make_view(work, stacked)
        result = CliRunner().invoke(cli, ["overlay", "verify", str(view), "--full"])
        assert result.exit_code == 0, result.output
        shutil.rmtree(view)
        if stacked:
            shutil.rmtree(work.root / "ov2")
