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

from flashnext import __version__
from flashnext.quant.errors import FlashnextError
from flashnext.quant.fsutil import atomic_directory, sha256_file
from flashnext.quant.overlay import MANIFEST_FILE, SCHEMA_VERSION, header_sha256
from flashnext.quant.snapshot import CONFIG_FILE, INDEX_FILE

VIEW_RECORD = ".flashnext-view.json"
MERGED = (INDEX_FILE, CONFIG_FILE)


def load_manifest(overlay: Path) -> dict:
    path = Path(overlay) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise FlashnextError(f"{overlay}: no {MANIFEST_FILE}; is this a flashnext overlay?") from None
    except ValueError as e:
        raise FlashnextError(f"{path}: not valid JSON ({e})") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise FlashnextError(f"{path}: schema_version {manifest.get('schema_version')!r} is not "
                             f"{SCHEMA_VERSION}; use the flashnext version that wrote it")
    return manifest


@dataclass(frozen=True)
class Mismatch:
    path: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def overlay_file_problems(overlay: Path, manifest: dict | None = None) -> list[Mismatch]:
    """The overlay's own files against its manifest, by size and content hash."""
    overlay = Path(overlay)
    manifest = manifest or load_manifest(overlay)
    problems = []
    for entry in manifest["replaces"] + manifest["adds"]:
        name = entry["path"]
        mine = overlay / name
        if not mine.is_file():
            problems.append(Mismatch(f"{overlay.name}/{name}", "missing from the overlay"))
        elif mine.stat().st_size != entry["size"] or sha256_file(mine) != entry["sha256"]:
            problems.append(Mismatch(f"{overlay.name}/{name}",
                                     f"overlay file changed since it was built (expected sha256 {entry['sha256'][:12]}…)"))
    return problems


def base_file_problems(base: Path, manifest: dict, full: bool = False) -> list[Mismatch]:
    """The base files an overlay replaces, by safetensors header hash (``full``: content hash)."""
    base = Path(base)
    problems = []
    for entry in manifest["replaces"]:
        name = entry["path"]
        theirs = base / name
        if not theirs.exists():
            problems.append(Mismatch(name, f"missing from the base snapshot {base}"))
            continue
        if theirs.stat().st_size != entry["base_size"]:
            problems.append(Mismatch(name, f"base file is {theirs.stat().st_size} bytes; the overlay was built "
                                           f"against {entry['base_size']} bytes"))
            continue
        if full or entry.get("base_header_sha256") is None:
            got, want, what = sha256_file(theirs), entry["base_sha256"], "sha256"
        else:
            got, want, what = header_sha256(theirs), entry["base_header_sha256"], "header sha256"
        if got != want:
            problems.append(Mismatch(name, f"base file differs from the one the overlay was built against "
                                           f"({what} {got[:12]}…, expected {want[:12]}…)"))
    for entry in manifest["adds"]:
        if (base / entry["path"]).exists():
            problems.append(Mismatch(entry["path"], "the overlay adds this file but the base already has one"))
    return problems


def verify_overlay(base: Path, overlay: Path, full: bool = False) -> list[Mismatch]:
    """Every problem found, one per file: overlay files by content hash; base files by safetensors
    header hash (``full``: by content hash)."""
    manifest = load_manifest(overlay)
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


def apply_overlays(base: Path, overlays: list[Path], out: Path, verify: bool = True, force: bool = False) -> dict:
    """Build the view ``out`` of ``base`` with ``overlays`` applied in order. Returns a summary."""
    base = Path(base).absolute()
    overlays = [Path(o).absolute() for o in overlays]
    if not (base / CONFIG_FILE).exists():
        raise FlashnextError(f"{base}: no {CONFIG_FILE}; is this a model snapshot?")
    manifests = [load_manifest(o) for o in overlays]
    if verify:
        for overlay in overlays:
            problems = verify_overlay(base, overlay)
            if problems:
                raise FlashnextError(f"{overlay.name} does not fit {base}: {problems[0]}"
                                     + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    # Which overlay provides each non-merged file.
    provider: dict[str, Path] = {}
    for overlay, manifest in zip(overlays, manifests):
        for entry in manifest["replaces"] + manifest["adds"]:
            name = entry["path"]
            if name in MERGED:
                continue
            if name in provider:
                raise FlashnextError(f"overlays {provider[name].name} and {overlay.name} both replace {name}; "
                                     "a shard cannot be merged without copying it, so they cannot be stacked")
            provider[name] = overlay

    base_index = json.loads((base / INDEX_FILE).read_text())
    index_versions, config_versions = [], []
    for overlay in overlays:
        if (overlay / INDEX_FILE).exists():
            index_versions.append((overlay.name, json.loads((overlay / INDEX_FILE).read_text())["weight_map"]))
        if (overlay / CONFIG_FILE).exists():
            config_versions.append((overlay.name, _flatten(json.loads((overlay / CONFIG_FILE).read_text()))))
    weight_map = _merge_changes(base_index["weight_map"], index_versions, "the index entry of tensor")
    config = _unflatten(_merge_changes(_flatten(json.loads((base / CONFIG_FILE).read_text())),
                                       config_versions, "config.json value"))

    with atomic_directory(out, force=force) as tmp:
        for entry in sorted(base.iterdir()):
            if entry.name in MERGED or entry.name == VIEW_RECORD or entry.name in provider:
                continue
            os.symlink(entry if entry.is_absolute() else entry.absolute(), tmp / entry.name)
        for name, overlay in provider.items():
            os.symlink(overlay / name, tmp / name)
        index = dict(base_index, weight_map=weight_map)
        if len(overlays) == 1 and (overlays[0] / INDEX_FILE).exists():
            os.symlink(overlays[0] / INDEX_FILE, tmp / INDEX_FILE)
        else:
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if len(overlays) == 1 and (overlays[0] / CONFIG_FILE).exists():
            os.symlink(overlays[0] / CONFIG_FILE, tmp / CONFIG_FILE)
        else:
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        record = {"flashnext_view": 1, "builder_version": __version__, "base": str(base),
                  "overlays": [str(o) for o in overlays]}
        (tmp / VIEW_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return {"view": str(Path(out).absolute()), "base": str(base), "overlays": [str(o) for o in overlays],
            "replaced_files": sorted(provider), "merged": [n for n in MERGED if len(overlays) > 1]}


def read_view(view: Path) -> dict | None:
    path = Path(view) / VIEW_RECORD
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def verify_view(view: Path, full: bool = False) -> list[Mismatch]:
    """Verify every overlay of a view against the view's base, and that the links still point where
    the view put them."""
    record = read_view(view)
    if record is None:
        raise FlashnextError(f"{view}: not a flashnext view (no {VIEW_RECORD})")
    problems = []
    for overlay in record["overlays"]:
        problems += verify_overlay(Path(record["base"]), Path(overlay), full)
    for entry in Path(view).iterdir():
        if entry.is_symlink() and not entry.exists():
            problems.append(Mismatch(entry.name, f"dangling link to {os.readlink(entry)}"))
    return problems
