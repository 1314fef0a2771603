"""What every overlay builder does, once: the skeleton that ``make-mtp-int4`` and ``repack-int6`` fill in.

A builder decides which base shards it rewrites and how (:meth:`OverlayBuilder.plan`), writes its
new tensors (:meth:`OverlayBuilder.fill`), and says what becomes of the index and config.json. The
skeleton does the rest the same way for all of them: the free-space check, the atomic output with
its guards (:func:`~flashnext.quant.checkpoint.fsutil.atomic_directory`), every untouched tensor of a
rewritten shard copied byte for byte, the shards closed only when complete, the index's
``total_size``, and ``overlay.json`` pinning each replaced base file by hash.

A builder whose fill takes hours opts into resuming (``resumable = True``): it says what a resume
must find unchanged (:meth:`OverlayBuilder.resume_identity`), gives its progress as JSON
(:meth:`OverlayBuilder.resume_state`) and takes it back only as far as it checks out
(:meth:`OverlayBuilder.restore`), and calls :meth:`OverlayBuilder.checkpoint` in ``fill`` after each
unit of work. The skeleton then builds in a partial overlay that an interruption keeps, with its
journal (:mod:`~flashnext.quant.overlays.resume`), and the next run of the same build continues it.

:data:`OVERLAY_KINDS` is the one registry of overlay kinds, keyed by what each builder class declares:
its ``kinds``, each an :class:`OverlayKind` with the tags its Hub model card carries and the
speculative method that loads it where it is a draft head's. A builder registers when its class is
defined; the builders of ``flashnext.quant.overlays`` are imported only when a kind is asked for
(so that reading a manifest never imports torch-heavy builders). Everything that acts on a kind (the
model card, its Use section) reads it there, so a new kind is its builder's module and nothing else::

    class MyBuilder(OverlayBuilder):
        kinds = (OverlayKind("my-kind", card_tags=("int4",)),)
        ...

    report = builder_for_kind("my-kind")(snapshot, ...).build(out, force=False)
"""

from __future__ import annotations

import copy
import importlib
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

from flashnext.quant.checkpoint.fsutil import (atomic_directory, check_free_space, existing_ancestor, output_directory,
                                               output_file, write_json)
from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, INDEX_FILE, Snapshot, read_config, read_index
from flashnext.quant.formats.safetensors_io import ShardWriter, TensorSpec, copy_tensor_bytes, read_header, shard_size
from flashnext.quant.overlays.manifest import OverlayManifest


@dataclass(frozen=True)
class OverlayKind:
    """One overlay kind (``overlay.json``'s ``"kind"``), declared by the builder that makes it: its
    name and what its model card says."""

    name: str
    card_tags: tuple[str, ...] = ()  # the card's tags after "flashnext", "overlay" and the kind
    # The --speculative-config method that loads the overlay, for a draft head's: the card names only
    # the profiles that speculate with it. None: every profile of the base model's family loads it.
    draft_method: str | None = None


class OverlayKinds:
    """Overlay kinds by name -> the builder class that declares each (its ``kinds``). A name is
    registered once: a second builder claiming a kind, or one builder naming it twice, is refused."""

    def __init__(self):
        self._builders: dict[str, type[OverlayBuilder]] = {}
        self._shipped_imported = False

    def register(self, cls: type[OverlayBuilder]) -> None:
        names = [k.name for k in cls.kinds]
        for name in names:
            other = self._builders.get(name)
            if other is not None or names.count(name) > 1:
                by = f"{other.__module__}.{other.__qualname__}" if other is not None else "it already"
                raise ValueError(f"{cls.__module__}.{cls.__qualname__} claims the overlay kind {name!r}, "
                                 f"which {by} claims")
        self._builders |= dict.fromkeys(names, cls)

    def unregister(self, cls: type[OverlayBuilder]) -> None:
        for k in cls.kinds:
            if self._builders.get(k.name) is cls:
                del self._builders[k.name]

    def _import_shipped(self) -> None:
        """Import every module of ``flashnext.quant.overlays`` once: each builder there registers
        as its class is defined."""
        if self._shipped_imported:
            return
        import flashnext.quant.overlays as package

        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            importlib.import_module(module.name)
        self._shipped_imported = True

    def builder(self, kind: str) -> type[OverlayBuilder] | None:
        self._import_shipped()
        return self._builders.get(kind)

    def get(self, kind: str) -> OverlayKind | None:
        cls = self.builder(kind)
        return next(k for k in cls.kinds if k.name == kind) if cls is not None else None

    def __iter__(self):
        self._import_shipped()
        return iter(list(self._builders))


OVERLAY_KINDS = OverlayKinds()


def builder_for_kind(kind: str) -> type["OverlayBuilder"] | None:
    """The builder that makes overlays of ``kind``, imported now (None for a kind no builder declares)."""
    return OVERLAY_KINDS.builder(kind)


class OverlayBuilder(ABC):
    kinds: ClassVar[tuple[OverlayKind, ...]]  # the overlay kinds it makes (overlay.json's "kind")
    tool: ClassVar[str]  # the command that runs it
    headroom: ClassVar[int] = 1 << 20  # free space wanted beyond the shards
    # An interrupted build continues where it stopped (see the module's docstring).
    resumable: ClassVar[bool] = False
    _run = None  # the ResumableOutput of a resumable build under way

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kinds" in cls.__dict__:
            OVERLAY_KINDS.register(cls)

    def __init__(self, snap: Snapshot):
        self.snap = snap

    @property
    def kind(self) -> str:
        """This build's kind: the builder's one kind (a builder of several says which)."""
        if len(self.kinds) != 1:
            raise NotImplementedError(f"{type(self).__name__} makes {len(self.kinds)} overlay kinds: "
                                      "its kind property says which this build is")
        return self.kinds[0].name

    @abstractmethod
    def plan(self) -> dict[str, list[TensorSpec]]:
        """Each rewritten base shard and its tensors in output order. A spec whose name the base
        shard has and that :meth:`rewritten` does not name is copied byte for byte."""

    def rewritten(self) -> set[str]:
        """Tensor names the builder writes itself although the base shard has a tensor of that name."""
        return set()

    @abstractmethod
    def fill(self, writers: dict[str, ShardWriter], progress: bool) -> None:
        """Write every tensor of the plan that is not copied."""

    def new_weight_map(self, plans: dict[str, list[TensorSpec]]) -> dict[str, str] | None:
        """The index's weight_map when tensors change names or shards; None: unchanged."""
        return None

    @abstractmethod
    def new_config(self) -> dict:
        """config.json of the overlay."""

    @abstractmethod
    def report(self) -> dict:
        """What the build did, for ``--json``, ``--report`` and the manifest (after :meth:`fill`)."""

    @classmethod
    def card_section(cls, report: dict) -> list[str]:
        """Markdown lines of the model card about this overlay's report."""
        return []

    def inputs(self) -> dict[str, Path]:
        """What the build reads besides the snapshot (by the name an error calls it): the overlay
        may not be, contain or lie inside any of them, so ``--force`` cannot remove one."""
        return {}

    def resume_identity(self) -> dict:
        """For a resumable builder: what a resume must find as the interrupted build had it (the
        source's identity, the settings the output depends on), each under the name the line that
        starts over gives it ("source snapshot"); JSON values. The overlay kind is always part of it."""
        raise NotImplementedError

    def resume_state(self) -> dict:
        """For a resumable builder: its progress as JSON, enough to go on from (work done, running
        sums). Floats come back exactly."""
        raise NotImplementedError

    def restore(self, state: dict, writers: dict[str, ShardWriter], progress: bool) -> None:
        """For a resumable builder: go on from ``state`` (what the journal gives as this build's
        :meth:`resume_state`) in ``writers``, the partial's shards reopened, each piece the journal
        records checked against their bytes. Nothing in ``state`` is taken on trust: a unit of work it
        says is done must be among those pieces (:meth:`ShardWriter.holds`), and every value the
        overlay or the report depends on is recomputed (from the source, and from the bytes written:
        :meth:`ShardWriter.read_bytes`) or checked against what is recomputed. Raise FlashnextError or
        ValueError, changing nothing, on anything that does not check out."""
        raise NotImplementedError

    def checkpoint(self) -> None:
        """Record the work done so far: a resumable builder's ``fill`` calls this after each unit of
        work; what the shards hold is made durable, then the journal says so. A no-op otherwise."""
        if self._run is not None:
            self._run.save(self.resume_state())

    def build(self, out: Path, force: bool = False, progress: bool = True,
              notice: Callable[[str], None] | None = None) -> dict:
        """Write the overlay ``out`` (never inside or over the snapshot). Returns the report.
        ``notice`` takes the line a resumable build says when it resumes or starts over (default:
        stderr)."""
        snap = self.snap
        plans = self.plan()
        metadata = {f: snap.header(f).metadata for f in plans}
        needed = sum(shard_size(specs, metadata[f]) for f, specs in plans.items()) + self.headroom
        manifest = OverlayManifest.new(self.kind, self.tool, snap.origin)
        inputs = {"the source snapshot": snap.root, **self.inputs()}
        if self.resumable:
            return self._build_resumable(out, force, progress, notice, plans, metadata, needed, manifest, inputs)
        check_free_space(existing_ancestor(out), needed, f"the overlay {out}")
        # Written through the partial directory's descriptor: a swap of it, or of its parent, for a
        # link into the snapshot changes nothing.
        with atomic_directory(out, force=force, inputs=inputs, made_by=self.tool, held=True) as tmp:
            writers = {f: ShardWriter(output_file(tmp, f), specs, metadata[f]) for f, specs in plans.items()}
            return self._write_overlay(tmp, writers, plans, manifest, progress)

    def _build_resumable(self, out: Path, force: bool, progress: bool, notice: Callable[[str], None] | None,
                         plans: dict[str, list[TensorSpec]], metadata: dict[str, dict], needed: int,
                         manifest: OverlayManifest, inputs: dict[str, Path]) -> dict:
        from flashnext.quant.overlays.resume import ResumableOutput, notice_on_stderr

        source = {"overlay kind": self.kind, **self.resume_identity()}
        with output_directory(out, force, inputs, self.tool) as output, \
                ResumableOutput(output, self.tool, source, notice or notice_on_stderr) as run:
            resumed = run.resume(plans, metadata, lambda state, writers: self.restore(state, writers, progress))
            check_free_space(existing_ancestor(out), max(0, needed - run.allocated()), f"the overlay {out}")
            if not resumed:
                run.start(plans, metadata, self.resume_state())
            self._run = run
            try:
                report = self._write_overlay(run.path, run.writers, plans, manifest, progress)
                run.commit()
            except FlashnextError:
                run.discard()
                raise
            finally:
                self._run = None
            return report

    def _write_overlay(self, tmp: Path, writers: dict[str, ShardWriter], plans: dict[str, list[TensorSpec]],
               manifest: OverlayManifest, progress: bool) -> dict:
        """Fill the shards open in ``writers`` inside the partial overlay ``tmp``, then write the rest
        of the overlay there and read it back. Untouched tensors are copied on every run, a resumed
        one's too: a byte copy is cheap, and so it is this run's source that they come from."""
        snap = self.snap
        rewritten = self.rewritten()
        try:
            for filename, writer in writers.items():
                header = snap.header(filename)
                for spec in plans[filename]:
                    if spec.name in header.entries and spec.name not in rewritten:
                        copy_tensor_bytes(snap.path(filename), header.entries[spec.name], writer)
            self.fill(writers, progress)
            for writer in writers.values():
                writer.close()
        except BaseException:
            for writer in writers.values():
                writer.abort()
            raise
        sizes = {f: w.size for f, w in writers.items()}
        files = list(plans)
        weight_map = self.new_weight_map(plans)
        if weight_map is not None or any(sizes[f] != snap.header(f).file_size for f in plans):
            index = copy.deepcopy(snap.index)
            if weight_map is not None:
                index["weight_map"] = weight_map
            index.setdefault("metadata", {})["total_size"] = _total_size(snap, index["weight_map"], plans)
            write_json(tmp / INDEX_FILE, index)
            files.append(INDEX_FILE)
        write_json(tmp / CONFIG_FILE, self.new_config())
        files.append(CONFIG_FILE)
        report = self.report() | {"bytes_written": sum(sizes.values())}
        manifest.report = report
        for name in files:
            manifest.replace(tmp, name, snap.path(name))
        manifest.write(tmp)
        check_readable(tmp, self.tool)
        # Last, so that every read of the snapshot (the copies, fill's, the hashes just pinned)
        # is covered: a source rewritten after it was read makes no overlay.
        snap.check_unchanged()
        return report


def check_readable(overlay: Path, tool: str) -> None:
    """Read the overlay about to be renamed into place with the readers its consumers use (``overlay
    verify``, ``overlay apply`` and a snapshot opened over a view), so that an output any of them
    would refuse fails the build, and nothing is written, instead of failing later."""
    try:
        for entry in OverlayManifest.load(overlay).files:
            path = overlay / entry.path
            if entry.path == CONFIG_FILE:
                read_config(path)
            elif entry.path == INDEX_FILE:
                read_index(path)
            elif entry.path.endswith(".safetensors"):
                read_header(path)
    except FlashnextError as e:
        raise FlashnextError(f"{tool} wrote nothing: what it made would be refused when read back ({e})") from None


def _total_size(snap: Snapshot, weight_map: dict[str, str], plans: dict[str, list[TensorSpec]]) -> int:
    """Tensor bytes of every shard the index names (the ``metadata.total_size`` convention: no
    headers), the rewritten shards as planned."""
    total = 0
    for filename in dict.fromkeys(weight_map.values()):
        if filename in plans:
            total += sum(spec.nbytes for spec in plans[filename])
        else:
            total += sum(e.nbytes for e in snap.header(filename).entries.values())
    return total

