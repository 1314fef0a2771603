"""Using overlays: verify one against a base snapshot, and apply several as a view of symlinks.

A *view* is a directory that ``vllm serve`` loads like a snapshot: every file is a symlink to the
base snapshot's file or to an overlay's replacement, except ``model.safetensors.index.json`` and
``config.json``, which are merged (small) files when overlays are stacked. Nothing large is copied.
A Hugging Face cache snapshot works as a base: its files are symlinks into ``blobs/`` and the view
links to the snapshot paths.

Stacking merges each overlay's changes relative to the base: the index's ``weight_map`` entries and
config.json's values (by JSON path). Two overlays that replace the same shard file, the same
tensor, or the same config value differently are refused, because a safetensors shard cannot be
merged without copying it.

The view records its base and overlays in ``.flashnext-view.json`` so that ``overlay verify VIEW``
can check it later.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from flashnext import __version__
from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.fsutil import OUTPUT_MARKER, atomic_directory, confined, sha256_file
from flashnext.quant.checkpoint.jsonfile import read_model
from flashnext.quant.checkpoint.records import StrictRecord
from flashnext.quant.overlays.manifest import MANIFEST_FILE, OverlayManifest, header_sha256
from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, INDEX_FILE, Snapshot, read_config, read_index

VIEW_RECORD = ".flashnext-view.json"
MERGED = (INDEX_FILE, CONFIG_FILE)


class ViewRecord(StrictRecord):
    """``VIEW/.flashnext-view.json``: what a view was made of."""

    flashnext_view: Literal[1]
    builder_version: str
    base: str
    overlays: list[str]


@dataclass(frozen=True)
class Mismatch:
    path: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def overlay_file_problems(overlay: Path, manifest: OverlayManifest | None = None) -> list[Mismatch]:
    """The overlay's own files against its manifest, by size and content hash."""
    overlay = Path(overlay)
    manifest = manifest or OverlayManifest.load(overlay)
    problems = []
    for entry in manifest.files:
        mine = confined(overlay, entry.path, str(overlay / MANIFEST_FILE))
        if not mine.is_file():
            problems.append(Mismatch(f"{overlay.name}/{entry.path}", "missing from the overlay"))
        elif mine.stat().st_size != entry.size or sha256_file(mine) != entry.sha256:
            problems.append(Mismatch(f"{overlay.name}/{entry.path}",
                                     f"overlay file changed since it was built (expected sha256 {entry.sha256[:12]}…)"))
    return problems


def base_file_problems(base: Path, manifest: OverlayManifest, full: bool = False) -> list[Mismatch]:
    """The base files an overlay replaces, by safetensors header hash (``full``: content hash)."""
    base = Path(base)
    problems = []
    for entry in manifest.replaces:
        name = entry.path
        theirs = confined(base, name, "overlay.json")
        if not theirs.is_file():
            problems.append(Mismatch(name, f"missing from the base snapshot {base}"))
            continue
        if theirs.stat().st_size != entry.base_size:
            problems.append(Mismatch(name, f"base file is {theirs.stat().st_size} bytes; the overlay was built "
                                           f"against {entry.base_size} bytes"))
            continue
        if full or entry.base_header_sha256 is None:
            got, want, what = sha256_file(theirs), entry.base_sha256, "sha256"
        else:
            try:
                got = header_sha256(theirs)
            except FlashnextError as e:
                problems.append(Mismatch(name, f"base file is not a valid safetensors file ({e})"))
                continue
            want, what = entry.base_header_sha256, "header sha256"
        if got != want:
            problems.append(Mismatch(name, f"base file differs from the one the overlay was built against "
                                           f"({what} {got[:12]}…, expected {want[:12]}…)"))
    for entry in manifest.adds:
        if os.path.lexists(confined(base, entry.path, "overlay.json")):
            problems.append(Mismatch(entry.path, "the overlay adds this file but the base already has one"))
    return problems


def verify_overlay(base: Path, overlay: Path, full: bool = False) -> list[Mismatch]:
    """Every problem found, one per file: overlay files by content hash; base files by safetensors
    header hash (``full``: by content hash)."""
    if not Path(base).is_dir():
        raise FlashnextError(f"{base}: the base snapshot is not a directory")
    manifest = OverlayManifest.load(overlay)
    return overlay_file_problems(overlay, manifest) + base_file_problems(base, manifest, full)


def _flatten(obj, prefix=()) -> dict[tuple, object]:
    if isinstance(obj, dict) and obj:
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, prefix + (k,)))
        return out
    return {prefix: obj}


def _unflatten(flat: dict[tuple, object]) -> dict:
    root: dict = {}
    for path, value in flat.items():
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise FlashnextError(f"the overlays change config.json {'.'.join(map(str, path))} in "
                                     "incompatible ways (a value and an object); they cannot be stacked")
        node[path[-1]] = value
    return root


_DELETED = object()


def _merge_changes(base: dict, versions: list[tuple[str, dict]], what: str) -> dict:
    """Apply each version's changes relative to ``base``; the same key changed two ways is refused."""
    merged = dict(base)
    owner: dict = {}
    for label, version in versions:
        for key in set(base) | set(version):
            old, new = base.get(key, _DELETED), version.get(key, _DELETED)
            if old == new:
                continue
            if key in owner and merged.get(key, _DELETED) != new:
                raise FlashnextError(f"overlays {owner[key]} and {label} both change {what} "
                                     f"{'.'.join(map(str, key)) if isinstance(key, tuple) else key}; "
                                     "they cannot be stacked")
            owner[key] = label
            if new is _DELETED:
                merged.pop(key, None)
            else:
                merged[key] = new
    return merged


def _quantization_holder(config: dict) -> dict | None:
    """The object that holds ``quantization_config`` (the config, or its ``text_config``)."""
    if isinstance(config.get("quantization_config"), dict):
        return config
    text = config.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("quantization_config"), dict):
        return text
    return None


def _group_names(config: dict) -> list[str]:
    holder = _quantization_holder(config)
    groups = holder["quantization_config"].get("config_groups") if holder else None
    return list(groups) if isinstance(groups, dict) else []


def _order_groups(config: dict, base_config: dict, overlay_configs: list[dict]) -> None:
    """Put the compressed-tensors groups each overlay added before the base's, the last overlay's
    first. vLLM gives a module the first group in order that targets it, and an overlay puts its
    group first so that it wins over a broader base target; merged key by key, the added groups
    would come after the base's and lose."""
    holder = _quantization_holder(config)
    if holder is None or not isinstance(holder["quantization_config"].get("config_groups"), dict):
        return
    groups = holder["quantization_config"]["config_groups"]
    base_names = _group_names(base_config)
    order: list[str] = []
    for overlay_config in reversed(overlay_configs):
        order += [g for g in _group_names(overlay_config) if g not in base_names and g not in order]
    order += [g for g in groups if g not in order]
    holder["quantization_config"]["config_groups"] = {g: groups[g] for g in order if g in groups}


def apply_overlays(base: Path, overlays: list[Path], out: Path, verify: bool = True, force: bool = False) -> dict:
    """Build the view ``out`` of ``base`` with ``overlays`` applied in order. Returns a summary."""
    base = Path(base).absolute()
    overlays = [Path(o).absolute() for o in overlays]
    snap = Snapshot.open(base)
    manifests = [OverlayManifest.load(o) for o in overlays]
    if verify:
        for overlay in overlays:
            problems = verify_overlay(base, overlay)
            if problems:
                raise FlashnextError(f"{overlay.name} does not fit {base}: {problems[0]}"
                                     + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    # Which overlay provides each non-merged file.
    provider: dict[str, Path] = {}
    for overlay, manifest in zip(overlays, manifests):
        for entry in manifest.files:
            name = entry.path
            if name in MERGED:
                continue
            if "/" in name:
                raise FlashnextError(f"{overlay / MANIFEST_FILE}: {name} is in a subdirectory; a view links "
                                     "top-level files only")
            if name in provider:
                raise FlashnextError(f"overlays {provider[name].name} and {overlay.name} both replace {name}; "
                                     "a shard cannot be merged without copying it, so they cannot be stacked")
            provider[name] = overlay

    index_versions, config_versions, overlay_configs = [], [], []
    for overlay in overlays:
        if (overlay / INDEX_FILE).exists():
            index_versions.append((overlay.name, read_index(overlay / INDEX_FILE)["weight_map"]))
        if (overlay / CONFIG_FILE).exists():
            overlay_config = read_config(overlay / CONFIG_FILE)
            overlay_configs.append(overlay_config)
            config_versions.append((overlay.name, _flatten(overlay_config)))
    weight_map = _merge_changes(snap.weight_map, index_versions, "the index entry of tensor")
    config = _unflatten(_merge_changes(_flatten(snap.config), config_versions, "config.json value"))
    _order_groups(config, snap.config, overlay_configs)

    inputs: dict[str, Path | None] = {"the base snapshot": base}
    inputs.update({f"the overlay {o}": o for o in overlays})
    with atomic_directory(out, force=force, inputs=inputs, made_by="overlay apply") as tmp:
        for entry in sorted(base.iterdir()):
            if entry.name in MERGED or entry.name in (VIEW_RECORD, OUTPUT_MARKER) or entry.name in provider:
                continue
            os.symlink(entry, tmp / entry.name)
        for name, overlay in provider.items():
            os.symlink(overlay / name, tmp / name)
        index = dict(snap.index, weight_map=weight_map)
        if len(overlays) == 1 and (overlays[0] / INDEX_FILE).exists():
            os.symlink(overlays[0] / INDEX_FILE, tmp / INDEX_FILE)
        else:
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if len(overlays) == 1 and (overlays[0] / CONFIG_FILE).exists():
            os.symlink(overlays[0] / CONFIG_FILE, tmp / CONFIG_FILE)
        else:
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        record = ViewRecord(flashnext_view=1, builder_version=__version__, base=str(base),
                            overlays=[str(o) for o in overlays])
        (tmp / VIEW_RECORD).write_text(json.dumps(record.model_dump(), indent=2) + "\n")
    return {"view": str(Path(out).absolute()), "base": str(base), "overlays": [str(o) for o in overlays],
            "replaced_files": sorted(provider), "merged": [n for n in MERGED if len(overlays) > 1]}


def read_view(view: Path) -> ViewRecord | None:
    """A view's record (None when ``view`` is no view); its base and overlays must be absolute
    paths of directories outside the view."""
    path = Path(view) / VIEW_RECORD
    if not path.is_file():
        return None
    record = read_model(path, ViewRecord, "a view record")
    for label, where in [("base", record.base)] + [(f"overlays.{i}", o) for i, o in enumerate(record.overlays)]:
        p = Path(where)
        if not p.is_absolute() or "\0" in where:
            raise FlashnextError(f"{path}: {label} {where!r} is not an absolute path")
        if p.resolve() == Path(view).resolve() or Path(view).resolve() in p.resolve().parents:
            raise FlashnextError(f"{path}: {label} {where!r} lies inside the view itself")
    return record


def verify_view(view: Path, full: bool = False) -> list[Mismatch]:
    """Verify every overlay of a view against the view's base, and that every link of the view
    still points into the base or one of its overlays."""
    record = read_view(view)
    if record is None:
        raise FlashnextError(f"{view}: not a flashnext view (no {VIEW_RECORD})")
    problems = []
    for overlay in record.overlays:
        problems += verify_overlay(Path(record.base), Path(overlay), full)
    roots = [Path(record.base)] + [Path(o) for o in record.overlays]
    for entry in sorted(Path(view).iterdir()):
        if not entry.is_symlink():
            continue
        target = Path(os.readlink(entry))
        if not entry.exists():
            problems.append(Mismatch(entry.name, f"dangling link to {target}"))
        elif not any(target == root / entry.name for root in roots):
            problems.append(Mismatch(entry.name, f"links to {target}, outside the view's base and overlays"))
    return problems
