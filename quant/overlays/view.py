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

The view records in ``.flashnext-view.json`` its base, its overlays and what every entry must be (a
link to a named base or overlay file, or a merged file with a sha256), so that ``overlay verify VIEW``
checks every entry later in both directions: missing, extra, wrong kind, wrong target, wrong content.

Only the files an overlay's manifest lists (and so pins by hash) are ever used: an overlay that
ships an index or config.json its manifest does not list is refused rather than silently merged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Literal

from flashnext import __version__
from flashnext.errors import FlashnextError
from flashnext.progress import Progress
from flashnext.quant.checkpoint.fsutil import OUTPUT_MARKER, atomic_directory, confined, sha256_file, write_json
from flashnext.quant.formats.ct_config import quantization_config_of
from flashnext.quant.records.jsonfile import read_json, validate
from flashnext.quant.records.strict import Count, Sha256, StrictRecord
from flashnext.quant.overlays.manifest import MANIFEST_FILE, OverlayManifest
from flashnext.quant.formats.safetensors_io import header_sha256, read_header
from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, INDEX_FILE, Snapshot, read_config, read_index

VIEW_RECORD = ".flashnext-view.json"
MERGED = (INDEX_FILE, CONFIG_FILE)


VIEW_RECORD_VERSION = 2


class MergedFile(StrictRecord):
    sha256: Sha256
    size: Count


class ViewRecord(StrictRecord):
    """``VIEW/.flashnext-view.json``: what a view was made of, and what each of its entries must be."""

    flashnext_view: Literal[2]
    builder_version: str
    base: str
    overlays: list[str]
    # entry name -> the absolute path it links to (the base's or an overlay's file of that name)
    links: dict[str, str]
    # entry name -> the merged file apply wrote there
    files: dict[str, MergedFile]


@dataclass(frozen=True)
class Mismatch:
    path: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def unlisted_merged_files(manifest: OverlayManifest, present: Iterable[str]) -> list[str]:
    """The index and config.json among ``present`` (an overlay's or a Hub repo's file names) that the
    manifest does not list: unpinned, so nothing may use them."""
    listed = {entry.path for entry in manifest.files}
    present = set(present)
    return [name for name in MERGED if name in present and name not in listed]


def refuse_unlisted_merged_files(manifest: OverlayManifest, present: Iterable[str], where: str) -> None:
    unlisted = unlisted_merged_files(manifest, present)
    if unlisted:
        raise FlashnextError(f"{where} ships {' and '.join(unlisted)}, which {MANIFEST_FILE} does not list "
                             "(so nothing pins it); refusing an overlay with unpinned files")


def _present_in(overlay: Path) -> list[str]:
    return [name for name in MERGED if os.path.lexists(overlay / name)]


HashProgress = Callable[[int], None] | None  # called with each chunk's byte count as a file is hashed


def overlay_file_problems(overlay: Path, manifest: OverlayManifest | None = None,
                          hashed: HashProgress = None) -> list[Mismatch]:
    """The overlay's own files against its manifest, by size and content hash; an index or
    config.json it ships unlisted is a problem too."""
    overlay = Path(overlay)
    manifest = manifest or OverlayManifest.load(overlay)
    problems = [Mismatch(f"{overlay.name}/{name}", f"in the overlay but not listed in its {MANIFEST_FILE}")
                for name in unlisted_merged_files(manifest, _present_in(overlay))]
    for entry in manifest.files:
        mine = confined(overlay, entry.path, str(overlay / MANIFEST_FILE))
        if not mine.is_file():
            problems.append(Mismatch(f"{overlay.name}/{entry.path}", "missing from the overlay"))
        elif mine.stat().st_size != entry.size or sha256_file(mine, hashed) != entry.sha256:
            problems.append(Mismatch(f"{overlay.name}/{entry.path}",
                                     f"overlay file changed since it was built (expected sha256 {entry.sha256[:12]}…)"))
    return problems


def base_file_problems(base: Path, manifest: OverlayManifest, full: bool = False,
                       hashed: HashProgress = None) -> list[Mismatch]:
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
            got, want, what = sha256_file(theirs, hashed), entry.base_sha256, "sha256"
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


def _kept_shard_problems(base: Path, manifests: list[OverlayManifest], found: list[Mismatch]) -> list[Mismatch]:
    """``--full``: the shards of the base that no overlay of ``manifests`` replaces (the base index
    names them), which a view links as they are and vLLM reads whole. No hash of them is recorded,
    so each is read as the safetensors library reads it: a regular file of the size its header
    claims (one truncated, or replaced by a directory or a FIFO, is a mismatch; one that cannot be
    opened at all is the command's one-line error). Not when the base index is among the problems
    ``found`` already."""
    base = Path(base)
    if INDEX_FILE in {p.path for p in found}:
        return []
    replaced = {entry.path for manifest in manifests for entry in manifest.replaces}
    index = base / INDEX_FILE
    problems = []
    for name in dict.fromkeys(read_index(index)["weight_map"].values()):
        if name in replaced:
            continue
        shard = confined(base, name, str(index))
        if not os.path.lexists(shard):
            problems.append(Mismatch(name, f"missing from the base snapshot {base}"))
            continue
        try:
            read_header(shard)
        except FlashnextError as e:
            problems.append(Mismatch(name, f"base file is not a valid safetensors file ({e})"))
    return problems


def verify_overlay(base: Path, overlay: Path, full: bool = False, progress: bool = False) -> list[Mismatch]:
    """Every problem found, one per file: overlay files by content hash; base files by safetensors
    header hash (``full``: by content hash, with a bar of the bytes hashed when ``progress``, and the
    base's other shards by :func:`_kept_shard_problems`)."""
    if not Path(base).is_dir():
        raise FlashnextError(f"{base}: the base snapshot is not a directory")
    manifest = OverlayManifest.load(overlay)
    with _hash_bar(_bytes_hashed(manifest, full), full and progress) as bar:
        problems = _overlay_problems(base, overlay, manifest, full, bar.update)
    return (problems + _kept_shard_problems(base, [manifest], problems)) if full else problems


def _overlay_problems(base: Path, overlay: Path, manifest: OverlayManifest, full: bool,
                      hashed: HashProgress) -> list[Mismatch]:
    return overlay_file_problems(overlay, manifest, hashed) + base_file_problems(base, manifest, full, hashed)


def _bytes_hashed(manifest: OverlayManifest, full: bool) -> int:
    """What verifying an overlay hashes, as its manifest records the sizes: every file of the overlay,
    and the base files it replaces that are hashed by content."""
    return (sum(e.size for e in manifest.files)
            + sum(e.base_size for e in manifest.replaces if full or e.base_header_sha256 is None))


def _hash_bar(total: int, enabled: bool) -> Progress:
    # Only --full has one: it reads every base shard an overlay replaces whole (minutes on the real
    # model); without it, only the overlay's own files are hashed.
    return Progress(total, enabled, "overlay verify")


def _flatten(obj, prefix=()) -> dict[tuple, object]:
    if isinstance(obj, dict) and obj:
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, prefix + (k,)))
        return out
    return {prefix: obj}


def _unflatten(flat: dict[tuple, object]) -> dict:
    # A path that is also the prefix of another is a value (or an empty object) in one overlay and
    # an object with members in another: refused whatever the order, for in one order the value
    # would silently replace the object (and one overlay's change be lost).
    for path in flat:
        for n in range(1, len(path)):
            if path[:n] in flat:
                raise FlashnextError(f"the overlays change config.json {'.'.join(map(str, path[:n]))} in "
                                     "incompatible ways (a value and an object); they cannot be stacked")
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


def _group_names(config: dict) -> list[str]:
    qc = quantization_config_of(config)
    groups = qc.get("config_groups") if qc else None
    return list(groups) if isinstance(groups, dict) else []


def _order_groups(config: dict, base_config: dict, overlay_configs: list[dict]) -> None:
    """Put the compressed-tensors groups each overlay added before the base's, the last overlay's
    first. vLLM gives a module the first group in order that targets it, and an overlay puts its
    group first so that it wins over a broader base target; merged key by key, the added groups
    would come after the base's and lose."""
    qc = quantization_config_of(config)
    if qc is None or not isinstance(qc.get("config_groups"), dict):
        return
    groups = qc["config_groups"]
    base_names = _group_names(base_config)
    order: list[str] = []
    for overlay_config in reversed(overlay_configs):
        order += [g for g in _group_names(overlay_config) if g not in base_names and g not in order]
    order += [g for g in groups if g not in order]
    qc["config_groups"] = {g: groups[g] for g in order if g in groups}


def _refuse_given_twice(overlays: list[Path]) -> None:
    """The same overlay directory named twice (by one path or two) is a mistake to name as such, not
    two overlays that both replace its files."""
    seen: dict[tuple[int, int], Path] = {}
    for overlay in overlays:
        try:
            st = os.stat(overlay)
        except OSError:
            continue  # its manifest's reader says what is wrong with it
        first = seen.setdefault((st.st_dev, st.st_ino), overlay)
        if first is not overlay:
            also = "" if first == overlay else f" (as {first} too)"
            raise FlashnextError(f"the overlay {overlay} is given twice{also}; give each overlay once")


class OverlayStack:
    """``overlays`` applied in order over the snapshot ``base``, merged in memory as a view serves
    them: the one home of the stacking rule, which :func:`apply_overlays` writes out as a view and
    the serving side reads as the model vLLM will load (:attr:`served`).

    Each part is read the first time it is asked for and kept, so that a question about one part
    reads only what that part needs: each overlay's manifest (``overlay.json``), its config.json and
    its index once, the base through ``open_base`` (default: :meth:`Snapshot.open`) once. Only the
    files an overlay's manifest lists are used; an index or config.json it ships unlisted is refused."""

    def __init__(self, base: Path, overlays: Iterable[Path], open_base: Callable[[], Snapshot] | None = None):
        self.base = Path(base)
        self.overlays = [Path(o) for o in overlays]
        self._open_base = open_base

    @cached_property
    def snapshot(self) -> Snapshot:
        """The base snapshot."""
        return self._open_base() if self._open_base is not None else Snapshot.open(self.base)

    @cached_property
    def manifests(self) -> list[OverlayManifest]:
        manifests = [OverlayManifest.load(o) for o in self.overlays]
        for overlay, manifest in zip(self.overlays, manifests):
            refuse_unlisted_merged_files(manifest, _present_in(overlay), str(overlay))
        return manifests

    @cached_property
    def _listed(self) -> list[set[str]]:
        return [{entry.path for entry in manifest.files} for manifest in self.manifests]

    @cached_property
    def providers(self) -> dict[str, Path]:
        """Which overlay provides each file it replaces or adds (the index and config.json aside,
        which are merged): a shard cannot be merged without copying it, so two overlays that
        provide the same file are refused."""
        provider: dict[str, Path] = {}
        for overlay, manifest in zip(self.overlays, self.manifests):
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
        return provider

    @cached_property
    def _indexes(self) -> dict[int, dict]:
        """Each overlay's index that its manifest lists, by the overlay's place in the stack."""
        return {i: read_index(overlay / INDEX_FILE) for i, (overlay, names) in
                enumerate(zip(self.overlays, self._listed)) if INDEX_FILE in names}

    @cached_property
    def _configs(self) -> dict[int, dict]:
        """Each overlay's config.json that its manifest lists, by the overlay's place in the stack."""
        return {i: read_config(overlay / CONFIG_FILE) for i, (overlay, names) in
                enumerate(zip(self.overlays, self._listed)) if CONFIG_FILE in names}

    def own_file(self, name: str) -> Path | None:
        """The overlay file a view links as its ``name`` (the index or config.json): a single
        overlay's own, which is the merge; None where the view holds a merged file."""
        if len(self.overlays) == 1 and name in self._listed[0]:
            return self.overlays[0] / name
        return None

    @cached_property
    def merged_weight_map(self) -> dict[str, str]:
        """The base index's ``weight_map`` with each overlay's changes to it applied in order."""
        versions = [(self.overlays[i].name, index["weight_map"]) for i, index in self._indexes.items()]
        return _merge_changes(self.snapshot.weight_map, versions, "the index entry of tensor")

    @cached_property
    def merged_config(self) -> dict:
        """The base's config.json with each overlay's changes to it applied in order (by JSON path),
        the compressed-tensors groups the overlays added first."""
        versions = [(self.overlays[i].name, _flatten(config)) for i, config in self._configs.items()]
        config = _unflatten(_merge_changes(_flatten(self.snapshot.config), versions, "config.json value"))
        _order_groups(config, self.snapshot.config, list(self._configs.values()))
        return config

    @property
    def config(self) -> dict:
        """The config.json the view serves: a single overlay's own (the base is not read for it),
        else the merge."""
        return self._configs[0] if self.own_file(CONFIG_FILE) is not None else self.merged_config

    @property
    def index(self) -> dict:
        """The index the view serves: a single overlay's own, else the base's with the merged ``weight_map``."""
        if self.own_file(INDEX_FILE) is not None:
            return self._indexes[0]
        return dict(self.snapshot.index, weight_map=self.merged_weight_map)

    @cached_property
    def served(self) -> Snapshot:
        """The model a view of the stack serves, as a :class:`Snapshot` held in memory: :attr:`config`
        and :attr:`index`, each tensor's file the overlay's that provides it, else the base's (whose
        shard headers are the base snapshot's, read once). The base itself without overlays."""
        if not self.overlays:
            return self.snapshot
        return StackedSnapshot(self.base, self.config, self.index, base=self.snapshot, providers=self.providers)


@dataclass
class StackedSnapshot(Snapshot):
    """A view that is not written out: :class:`OverlayStack`'s served model. A file an overlay
    provides is read from that overlay; any other from the base snapshot, through its own reader."""

    base: Snapshot | None = None
    providers: dict[str, Path] | None = None

    def path(self, filename: str) -> Path:
        overlay = self.providers.get(filename)
        if overlay is None:
            return self.base.path(filename)
        return confined(overlay, filename, str(overlay / INDEX_FILE))

    def header(self, filename: str):
        if filename not in self.providers:
            return self.base.header(filename)
        return super().header(filename)


def apply_overlays(base: Path, overlays: list[Path], out: Path, verify: bool = True, force: bool = False,
                   stack: OverlayStack | None = None) -> dict:
    """Build the view ``out`` of ``base`` with ``overlays`` applied in order. Returns a summary.
    ``stack``: the :class:`OverlayStack` of ``base`` and ``overlays`` already read (its base and
    overlays as they were given to it), so that what it read is not read again."""
    base = Path(base).absolute()
    overlays = [Path(o).absolute() for o in overlays]
    _refuse_given_twice(overlays)
    if stack is None:
        stack = OverlayStack(base, overlays)
    stack.snapshot, stack.manifests  # the base opened, each manifest read and its merged files listed
    if verify:
        for overlay in overlays:
            problems = verify_overlay(base, overlay)
            if problems:
                raise FlashnextError(f"{overlay.name} does not fit {base}: {problems[0]}"
                                     + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    absolute = dict(zip(stack.overlays, overlays))  # the stack's overlays as given, in the same order
    provider = {name: absolute[overlay] for name, overlay in stack.providers.items()}
    stack.merged_weight_map, stack.merged_config  # a stack that cannot be merged is refused, whatever is linked

    links: dict[str, str] = {}
    for entry in sorted(base.iterdir()):
        if entry.name not in MERGED and entry.name not in (VIEW_RECORD, OUTPUT_MARKER) and entry.name not in provider:
            links[entry.name] = str(entry)
    for name, overlay in provider.items():
        links[name] = str(overlay / name)
    merged: dict[str, object] = {}
    for name, content in ((INDEX_FILE, lambda: stack.index), (CONFIG_FILE, lambda: stack.config)):
        if stack.own_file(name) is not None:
            links[name] = str(overlays[0] / name)  # one overlay: its own file is the merge
        else:
            merged[name] = content()

    inputs: dict[str, Path | None] = {"the base snapshot": base}
    inputs.update({f"the overlay {o}": o for o in overlays})
    with atomic_directory(out, force=force, inputs=inputs, made_by="overlay apply", held=True) as tmp:
        for name, target in links.items():
            os.symlink(target, tmp / name)
        files = {}
        for name, content in merged.items():
            write_json(tmp / name, content)
            # The hash of what is on disk, so that verify compares like with like.
            files[name] = MergedFile(sha256=sha256_file(tmp / name), size=(tmp / name).stat().st_size)
        record = ViewRecord(flashnext_view=VIEW_RECORD_VERSION, builder_version=__version__, base=str(base),
                            overlays=[str(o) for o in overlays], links=links, files=files)
        write_json(tmp / VIEW_RECORD, record.model_dump())
    return {"view": str(Path(out).absolute()), "base": str(base), "overlays": [str(o) for o in overlays],
            "replaced_files": sorted(provider), "merged": [n for n in MERGED if len(overlays) > 1]}


def read_view(view: Path) -> ViewRecord | None:
    """A view's record (None when ``view`` is no view); its base and overlays must be absolute
    paths of directories outside the view, its entries top-level names, and each link's target the
    base's or an overlay's file of the entry's own name."""
    path = Path(view) / VIEW_RECORD
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_file():
        raise FlashnextError(f"{path}: the view record is not a regular file")
    data = read_json(path, "a view record")
    if data.get("flashnext_view") == 1:
        raise FlashnextError(f"{path}: this view was made by an older flashnext that did not record what each "
                             "entry must be; make it again with `flashnext overlay apply --force`")
    record = validate(data, ViewRecord, str(path))
    for label, where in [("base", record.base)] + [(f"overlays.{i}", o) for i, o in enumerate(record.overlays)]:
        p = Path(where)
        if not p.is_absolute() or "\0" in where:
            raise FlashnextError(f"{path}: {label} {where!r} is not an absolute path")
        if p.resolve() == Path(view).resolve() or Path(view).resolve() in p.resolve().parents:
            raise FlashnextError(f"{path}: {label} {where!r} lies inside the view itself")
    roots = [record.base, *record.overlays]
    for name in [*record.links, *record.files]:
        confined(Path(view), name, str(path))
        if "/" in name or name in (VIEW_RECORD, OUTPUT_MARKER):
            raise FlashnextError(f"{path}: {name!r} cannot be an entry of a view")
    both = sorted(set(record.links) & set(record.files))
    if both:
        raise FlashnextError(f"{path}: {both[0]} is recorded both as a link and as a merged file")
    for name, target in record.links.items():
        if not any(target == str(Path(root) / name) for root in roots):
            raise FlashnextError(f"{path}: links.{name} {target!r} is not the base's or an overlay's {name}")
    return record


def _entry_problem(view: Path, name: str, record: ViewRecord) -> str | None:
    """What is wrong with the view's entry ``name`` against its record, or None."""
    entry = view / name
    if name in record.links:
        target = record.links[name]
        if not os.path.lexists(entry):
            return f"missing from the view (should link to {target})"
        if not entry.is_symlink():
            kind = "directory" if entry.is_dir() else "file"
            return f"is a real {kind}, not the link to {target} the view was made with"
        found = os.readlink(entry)
        if found != target:
            return f"links to {found}, not to {target} as the view was made"
        if not entry.exists():
            return f"dangling link to {target}"
        return None
    if name in record.files:
        want = record.files[name]
        if not os.path.lexists(entry):
            return "missing from the view (a merged file overlay apply wrote)"
        if entry.is_symlink() or not entry.is_file():
            what = f"a link to {os.readlink(entry)}" if entry.is_symlink() else "not a regular file"
            return f"is {what}, not the merged file overlay apply wrote"
        if entry.stat().st_size != want.size or sha256_file(entry) != want.sha256:
            return f"changed since the view was made (expected sha256 {want.sha256[:12]}…)"
        return None
    return "not part of the view (overlay apply did not make it)"


def verify_view(view: Path, full: bool = False, progress: bool = False) -> list[Mismatch]:
    """Verify every overlay of a view against the view's base, and every entry of the view against
    its record, both ways: what the record names must be there as recorded, and nothing else may be.
    With ``full`` and ``progress``, a bar of the bytes hashed."""
    view = Path(view)
    record = read_view(view)
    if record is None:
        raise FlashnextError(f"{view}: not a flashnext view (no {VIEW_RECORD})")
    if record.overlays and not Path(record.base).is_dir():
        raise FlashnextError(f"{record.base}: the base snapshot is not a directory")
    manifests = [(Path(overlay), OverlayManifest.load(Path(overlay))) for overlay in record.overlays]
    with _hash_bar(sum(_bytes_hashed(m, full) for _, m in manifests), full and progress) as bar:
        return _view_problems(view, record, manifests, full, bar.update)


def _view_problems(view: Path, record: ViewRecord, manifests: list[tuple[Path, OverlayManifest]], full: bool,
                   hashed: HashProgress) -> list[Mismatch]:
    problems = []
    for overlay, manifest in manifests:
        problems += _overlay_problems(Path(record.base), overlay, manifest, full, hashed)
        # A record whose links were rewritten to match a tampered view still cannot make a file the
        # overlay replaces come from anywhere but the overlay.
        for entry in manifest.files:
            want = str(overlay / entry.path)
            if entry.path not in MERGED and entry.path in record.links and record.links[entry.path] != want:
                problems.append(Mismatch(entry.path, f"the view record links it to {record.links[entry.path]}, "
                                                     f"but the overlay {overlay} replaces it"))
    if full and manifests:
        problems += _kept_shard_problems(Path(record.base), [m for _, m in manifests], problems)
    names = set(record.links) | set(record.files) | {e.name for e in os.scandir(view)}
    for name in sorted(names - {VIEW_RECORD, OUTPUT_MARKER}):
        problem = _entry_problem(view, name, record)
        if problem:
            problems.append(Mismatch(name, problem))
    return problems
