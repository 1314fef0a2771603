"""Issue 42: ``overlay apply`` of overlays that do not stack (``docs/overlays.md``, "Several
overlays stack in order"): two that replace the same shard (so the same tensors), that change the
same config value differently or a value where the other has an object, made for another base, one
given twice, a view or a snapshot given as an overlay. The second overlay is a builder's (``ple
build --format``, ``repack-int6``) or a copy of one reduced to its config.json and pinned again.

Each is refused in one line with exit 1 and nothing written, or stacks as the docs promise: every
overlay's change in the view, the compressed-tensors groups the overlays added first (the last
overlay's first), and ``overlay verify VIEW`` content with it. The one documented gap is shown as
such: an overlay of another base whose shards differ from this one's only in tensor values passes
``apply``'s header check, and ``overlay verify --full VIEW`` then names the base file that differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from flashnext.tools.cli import main as cli
from support.hostile import Work, invoke_expecting_one_line, tree_state
from support.shards import rewrite_shard

PLE_SHARD = "model-00003-of-00005.safetensors"


def build(argv: list[str]) -> None:
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output


def _base_with(root: Path, name: str, pristine: Path, edit: Callable[[Path], None]) -> Path:
    snap = root / name
    shutil.copytree(pristine / "snap", snap)
    edit(snap)
    return snap


def _other_config(snap: Path) -> None:
    config = json.loads((snap / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = 2e-6
    (snap / "config.json").write_text(json.dumps(config))


def _other_values(snap: Path) -> None:
    """The PLE table's shard file with other rows: the same header, other bytes."""
    def edit(tensors):
        for name in tensors:
            tensors[name] = tensors[name] * 0.5
    rewrite_shard(snap / PLE_SHARD, edit)


@pytest.fixture(scope="module")
def built(pristine, tmp_path_factory) -> dict[str, Path]:
    """Overlays of the work tree's snapshot from the builders, and of two other bases."""
    root = tmp_path_factory.mktemp("stack")
    snap = pristine / "snap"
    ple = lambda src, out, fmt: ["ple", "build", "--src", str(src), "--out", str(out), "--format", fmt, "--no-progress"]
    made = {"nvfp4": root / "nvfp4", "fp8": root / "fp8", "int6": root / "int6", "int8": root / "int8"}
    build(ple(snap, made["nvfp4"], "nvfp4"))
    build(ple(snap, made["fp8"], "fp8"))
    build(["repack-int6", "--src", str(snap), "--out", str(made["int6"]), "--no-progress"])
    build(["repack-int6", "--src", str(snap), "--out", str(made["int8"]), "--to", "int8", "--no-progress"])
    for name, edit in (("other-config", _other_config), ("other-values", _other_values)):
        made[name] = root / f"nvfp4-of-{name}"
        build(ple(_base_with(root, name, pristine, edit), made[name], "nvfp4"))
    return made


def config_only(w: Work, name: str, edit: Callable[[dict], None]) -> Path:
    """An overlay that replaces only config.json: the mtp-int4 overlay's manifest, reduced to it and
    pinned again (its sha256 and size, and the base's)."""
    overlay = w.root / name
    overlay.mkdir()
    config = json.loads((w.snap / "config.json").read_text())
    edit(config)
    (overlay / "config.json").write_text(json.dumps(config, indent=2))
    data, base = (overlay / "config.json").read_bytes(), (w.snap / "config.json").read_bytes()
    manifest = json.loads((w.ov / "overlay.json").read_text())
    manifest["replaces"] = [{"path": "config.json", "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                             "base_sha256": hashlib.sha256(base).hexdigest(), "base_size": len(base),
                             "base_header_sha256": None}]
    (overlay / "overlay.json").write_text(json.dumps(manifest))
    return overlay


def text(**values) -> Callable[[dict], None]:
    return lambda config: config["text_config"].update(values)


def dropped(key: str) -> Callable[[dict], None]:
    return lambda config: config["text_config"].pop(key)


def configs(*edits: Callable[[dict], None]) -> Callable[[Work, dict], list[Path]]:
    return lambda w, built: [config_only(w, f"c{i}", edit) for i, edit in enumerate(edits)]


def view_of_the_overlay(w: Work, built) -> list[Path]:
    build(["overlay", "apply", str(w.ov), "--base", str(w.snap), "--out", str(w.root / "view1")])
    return [w.root / "view1"]


def a_link_to(name: str) -> Callable[[Work, dict], list[Path]]:
    def overlays(w: Work, built) -> list[Path]:
        os.symlink(built[name], w.root / "same")
        return [built[name], w.root / "same"]
    return overlays


@dataclass(frozen=True)
class Stack:
    id: str
    overlays: Callable[[Work, dict], list[Path]]
    message: str  # the refusal's words


REFUSED = [
    # The same shard file (the same tensors), from two builders' runs.
    Stack("nvfp4-and-fp8", lambda w, b: [b["nvfp4"], b["fp8"]], f"both replace {PLE_SHARD}"),
    Stack("int6-and-int8", lambda w, b: [b["int6"], b["int8"]], "both replace model-00001-of-00005.safetensors"),
    # The same config value changed two ways, or changed and removed.
    Stack("config-two-values", configs(text(rms_norm_eps=1e-5), text(rms_norm_eps=2e-5)),
          "both change config.json value text_config.rms_norm_eps"),
    Stack("config-value-and-removed", configs(text(rms_norm_eps=1e-5), dropped("rms_norm_eps")),
          "both change config.json value text_config.rms_norm_eps"),
    # A value in one, an object in the other: refused in either order (in one, the value silently
    # replaced the object, losing the first overlay's change).
    Stack("config-value-then-object", configs(text(x=1), text(x={"y": 2})), "text_config.x in incompatible ways"),
    Stack("config-object-then-value", configs(text(x={"y": 2}), text(x=1)), "text_config.x in incompatible ways"),
    Stack("config-object-then-empty", configs(text(x={"y": 2}), text(x={})), "text_config.x in incompatible ways"),
    Stack("config-empty-then-object", configs(text(x={}), text(x={"y": 2})), "text_config.x in incompatible ways"),
    # Made for another base: its pinned config.json differs from this base's.
    Stack("another-base", lambda w, b: [w.ov, b["other-config"]], "does not fit"),
    # One overlay twice, by one path or through a link to it.
    Stack("given-twice", lambda w, b: [w.ov, w.ov], "is given twice; give each overlay once"),
    Stack("given-twice-through-a-link", a_link_to("nvfp4"), "is given twice (as"),
    # Not an overlay at all.
    Stack("a-view", view_of_the_overlay, "no overlay.json"),
    Stack("a-view-after-an-overlay", lambda w, b: [b["nvfp4"], *view_of_the_overlay(w, b)], "no overlay.json"),
    Stack("the-base", lambda w, b: [w.snap], "no overlay.json"),
]


def apply_argv(w: Work, overlays: list[Path], *extra: str) -> list[str]:
    return ["overlay", "apply", *map(str, overlays), "--base", str(w.snap), "--out", str(w.root / "view"), *extra]


@pytest.mark.parametrize("stack", REFUSED, ids=[s.id for s in REFUSED])
def test_overlays_that_do_not_stack_are_refused_in_one_line(stack: Stack, built, work: Work):
    argv = apply_argv(work, stack.overlays(work, built))
    before, made = tree_state(work.root), {k: tree_state(v) for k, v in built.items()}
    result, line = invoke_expecting_one_line(argv)
    assert result.exit_code == 1 and line.startswith("Error: ") and stack.message in line, line
    assert tree_state(work.root) == before and {k: tree_state(v) for k, v in built.items()} == made


def _groups(config: dict) -> list[str]:
    return list(config["quantization_config"]["config_groups"])


@pytest.mark.parametrize("order", [("mtp", "nvfp4", "int6"), ("int6", "nvfp4", "mtp")], ids="+".join)
def test_overlays_that_stack_give_each_change_in_the_documented_order(order, built, work: Work):
    """The mtp-int4, PLE NVFP4 and INT6 bit-plane overlays replace different shards: stacked in
    either order every overlay's change is in the view, its added groups first, the last overlay's
    first; and the view verifies."""
    paths = {"mtp": work.ov, **built}
    result = CliRunner().invoke(cli, apply_argv(work, [paths[o] for o in order]))
    assert result.exit_code == 0, result.output
    view = work.root / "view"
    config = json.loads((view / "config.json").read_text())
    base = json.loads((work.snap / "config.json").read_text())
    assert config["text_config"]["ple_embedding_dtype"] == "nvfp4"
    added = []
    for o in reversed(order):
        mine = json.loads((paths[o] / "config.json").read_text())
        added += [g for g in _groups(mine) if g not in _groups(base) and g not in added]
        for g in _groups(mine):  # each overlay's own groups as it wrote them
            assert config["quantization_config"]["config_groups"][g] == \
                mine["quantization_config"]["config_groups"][g] or g in _groups(base)
    assert added and _groups(config)[:len(added)] == added
    for name, o in ((f, o) for o in order for f in os.listdir(paths[o]) if f.endswith(".safetensors")):
        assert os.readlink(view / name) == str(paths[o] / name)
    verify = CliRunner().invoke(cli, ["overlay", "verify", str(view)])
    assert verify.exit_code == 0, verify.output


def test_config_changes_that_agree_stack(built, work: Work):
    """Two overlays that make the same change, or change different members of one object, stack."""
    overlays = configs(text(rms_norm_eps=1e-5, x={"y": 2}), text(rms_norm_eps=1e-5, x={"y": 2, "z": 3}))(work, built)
    result = CliRunner().invoke(cli, apply_argv(work, overlays))
    assert result.exit_code == 0, result.output
    config = json.loads((work.root / "view" / "config.json").read_text())["text_config"]
    assert config["rms_norm_eps"] == 1e-5 and config["x"] == {"y": 2, "z": 3}


def test_an_overlay_of_a_base_with_other_values_is_found_by_verify_full(built, work: Work):
    """The documented gap: ``apply`` checks a replaced base shard by its header hash, which an
    overlay of a base with the same headers and other tensor values passes; ``overlay verify --full``
    on the view names the base file that differs (exit 3)."""
    result = CliRunner().invoke(cli, apply_argv(work, [built["other-values"]]))
    assert result.exit_code == 0, result.output
    verify = CliRunner().invoke(cli, ["overlay", "verify", "--full", "--no-progress", str(work.root / "view")])
    assert verify.exit_code == 3, verify.output
    assert f"{PLE_SHARD}: base file differs from the one the overlay was built against (sha256" in verify.output
