"""The vLLM patch series' mechanics: its zero-fuzz check, the probes, and its application in place.

What each patch is (its diff, switch, hooks, probe, touched files) is in the registry,
``serving/patches/series.py``; this module only applies and checks what that registry lists.

``check`` never touches the installed package. It builds a shadow tree: every entry of the
installed ``vllm`` is symlinked except along the touched paths, where directories are recreated
and the touched files copied. It applies the series there with ``patch --fuzz=0`` (the first
refused hunk is named), byte-compiles every touched file, and runs every probe in one fresh
interpreter that imports the patched tree (it first makes sure ``vllm`` comes from the shadow
tree; a diff's probe is derived from the diff, every other a function of ``serving/patches/probes.py``;
each is reported by its entry's id).
``--vllm`` may also name another vllm directory or a vllm wheel.

``apply`` changes the serving image's vllm in place, all or nothing: the touched files are patched
and compiled in a stage beside it and swapped in only once the whole series applied; their
originals and hashes are recorded first (``RECORD_DIR``), so that ``apply --revert`` restores them
byte for byte and a rerun finishes a swap that was killed halfway, or says the tree is patched.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import time
import zipfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Literal, Sequence

from flashnext import envs
from flashnext.errors import FlashnextError, named
from flashnext.quant.checkpoint.fsutil import (confined, fsync_dir, interrupts_held, output_lock, read_output_marker,
                                               scratch_directory, write_marker)
from flashnext.quant.records.inputs import open_regular, read_regular_bytes
from flashnext.quant.records.jsonfile import parse_json, validate
from flashnext.quant.records.strict import Sha256, StrictRecord
from flashnext.serving.patches import probe_runner, probes
from flashnext.serving.patches.series import ABSORBED, PATCH_DIR, SERIES, VLLM_VERSION, Absorbed, Patch


def load_series(patches: Sequence[Patch] = SERIES) -> list[Patch]:
    """``patches`` in order, each checked: its probe is found by its module and name, a diff is a
    regular file in the series' folder that changes at least one file, a plugin entry has none."""
    patches = sorted(patches, key=lambda p: p.order)
    for p in patches:
        probe = p.probe or probes.lines_in_tree
        # the probe interpreter finds a probe by its module and name, so it must be found there
        if getattr(importlib.import_module(probe.__module__), probe.__name__, None) is not probe:
            raise FlashnextError(f"{p.id}: its probe {probe.__qualname__} is not a function of a module")
        if p.verdict == "plugin":
            if p.file is not None:
                raise FlashnextError(f"{p.id}: a plugin entry has no diff and touches no file of vllm")
            continue
        confined(PATCH_DIR, p.file, "the patch series")
        diff = read_regular_bytes(p.path, "a patch of the series").decode("utf-8", "replace")
        if not probes.diff_hunks(diff):
            raise FlashnextError(f"{p.id}: {p.file} has no hunk of a unified diff")
    return patches


def diffs(patches: Sequence[Patch]) -> list[Patch]:
    """The entries kept as diffs (applied to vLLM's files), in order; plugin entries register
    through vLLM's own extension points instead (``serving/plugin.py``)."""
    return [p for p in patches if p.verdict == "diff"]


def probe_calls(entries: Sequence[Patch | Absorbed]) -> dict[str, tuple[Callable[..., None], tuple]]:
    """Each entry's probe and the arguments it is called with. A diff's is derived from its hunks:
    the lines each adds that no later diff of ``entries`` removes (a later patch may rewrite what an
    earlier one added, as mtp-02 does mtp-01's draft embedding)."""
    hunks = {p.id: probes.diff_hunks(p.path.read_text(encoding="utf-8")) for p in entries
             if isinstance(p, Patch) and p.verdict == "diff" and p.probe is None}
    calls = {}
    for n, p in enumerate(entries):
        if p.id not in hunks:
            calls[p.id] = (p.probe, ())
            continue
        later = [(rel, set(removed)) for q in entries[n + 1:] for rel, _, removed in hunks.get(q.id, ())]
        kept = [(rel, [line for line in added if not any(r == rel and line in gone for r, gone in later)])
                for rel, added, _ in hunks[p.id]]
        calls[p.id] = (probes.lines_in_tree, (p.file, kept))
    return calls


def installed_vllm_root() -> Path:
    """The directory holding the installed ``vllm`` package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        from flashnext.serving import vllm_release

        raise FlashnextError(f"{vllm_release.support_line(None)}; or pass {named('vllm')} PATH")
    return Path(spec.origin).parent.parent


def _shadow_tree(source_root: Path, touched: set[str], dest: Path) -> None:
    """``dest/vllm`` mirrors ``source_root/vllm`` by symlinks, with real copies along ``touched``."""
    needed_dirs = {str(Path(t).parent) for t in touched}
    needed_dirs |= {str(p) for t in touched for p in Path(t).parents if str(p) != "."}

    def build(rel: str) -> None:
        src, dst = source_root / rel, dest / rel
        dst.mkdir(parents=True, exist_ok=True)
        for entry in os.scandir(src):
            child = f"{rel}/{entry.name}"
            if child in needed_dirs and entry.is_dir():
                build(child)
            elif child in touched:
                shutil.copy2(entry.path, dst / entry.name)
            elif entry.name != "__pycache__":
                os.symlink(entry.path, dst / entry.name)

    build("vllm")


def _apply(patch: Patch, root: Path) -> None:
    cmd = ["patch", "-p1", "--fuzz=0", "--forward", "--batch", "--no-backup-if-mismatch", "-d", str(root), "-i", str(patch.path)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise FlashnextError("the `patch` program is not installed (apt-get install patch)") from None
    if out.returncode != 0:
        if "Reversed (or previously applied) patch detected" in out.stdout + out.stderr:
            raise FlashnextError(f"patch {patch.id} is applied already to this vllm")
        failed = [line for line in (out.stdout + out.stderr).splitlines() if "FAILED" in line or "can't find" in line]
        raise FlashnextError(f"patch {patch.id} does not apply with zero fuzz to this vllm: "
                             f"{failed[0] if failed else (out.stdout + out.stderr).strip().splitlines()[-1]}")


def patched_tree(dest: Path, series: Sequence[Patch] = SERIES) -> Path:
    """The installed vLLM with the whole series applied, as a shadow tree at ``dest`` (put it first
    on PYTHONPATH). The installed package is not touched."""
    patches = diffs(load_series(series))
    _shadow_tree(installed_vllm_root(), {t for p in patches for t in p.touches}, Path(dest))
    for p in patches:
        _apply(p, Path(dest))
    return Path(dest)


# What `patches apply` keeps beside the vllm it patched (in the same site-packages): the touched
# files' originals and record.json, which names the series and every file's sha256 before and after.
RECORD_DIR = ".flashnext-vllm-patches"
RECORD_FILE = "record.json"
ORIGINALS = "originals"
_MADE_BY = "flashnext patches apply"
_CHECKED_BY = "flashnext patches check"  # what the scratch of a check or of the probes says made it
_LEFTOVER = re.compile(re.escape(RECORD_DIR) + r"\.(?:stage|partial)-[0-9]+")


def series_sha256(patches: list[Patch]) -> str:
    """What identifies a series: its patches' ids and diffs, in order."""
    digest = hashlib.sha256()
    for p in patches:
        diff = read_regular_bytes(p.path, "a patch of the series")
        digest.update(f"{p.id}\0{len(diff)}\0".encode() + diff)
    return digest.hexdigest()


@dataclass(frozen=True)
class SeriesApplied:
    """What ``patches apply`` did: the ids applied (in order), or that they already were."""

    ids: list[str]
    already: bool
    record: Path


def _create_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """A new file with ``data``, created exclusively and never through a link, synced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode & 0o7777)
    try:
        os.fchmod(fd, mode & 0o7777)  # not the umask's
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.flashnext-{os.getpid()}.tmp")


def _replace_file(path: Path, data: bytes, mode: int, mtime_ns: int | None = None) -> None:
    """``path``'s content becomes ``data`` at once (a sibling written in full, then renamed over it).
    An original gets its ``mtime_ns`` back too, so the bytecode Python cached for it is valid again."""
    tmp = _tmp_sibling(path)
    try:
        _create_file(tmp, data, mode)
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _swap_in(target: Path, rel: str, data: bytes, mode: int) -> None:
    """Install one patched file in the target (tests stop a swap here)."""
    _replace_file(target / rel, data, mode)


def _compile(patch: Patch, root: Path, rel: str, cfile: Path) -> None:
    """Byte-compile ``root/rel`` (after ``patch``) into ``cfile``, away from the tree's own bytecode."""
    try:
        py_compile.compile(str(root / rel), cfile=str(cfile), doraise=True)
    except py_compile.PyCompileError as e:
        raise FlashnextError(f"patch {patch.id}: {rel} no longer compiles: {e.msg.strip().splitlines()[-1]}") from None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_target_file(target: Path, rel: str) -> tuple[bytes, os.stat_result]:
    """A touched file of the target vllm and its status; it must be a regular file (no link: the
    swap would replace the link, not what it points to)."""
    path = confined(target, rel, "the patch series")
    try:
        with open_regular(path, "a file of the vllm package", follow_symlinks=False) as f:
            return f.read(), os.fstat(f.fileno())
    except FileNotFoundError:
        raise FlashnextError(f"{path}: missing; the series patches vllm=={VLLM_VERSION}, which has it") from None


class RecordedFile(StrictRecord):
    """One file ``patches apply`` changed: its bytes before and after (sha256), mode and mtime."""

    original_sha256: Sha256
    patched_sha256: Sha256
    mode: int
    mtime_ns: int


class PatchRecord(StrictRecord):
    """``.flashnext-vllm-patches/record.json`` in a patched vllm tree: which series was applied, and
    every file it changed (the originals are kept beside it)."""

    made_by: Literal["flashnext patches apply"]
    series: list[str]
    series_sha256: Sha256
    files: dict[str, RecordedFile]

    @classmethod
    def not_this_record(cls, data) -> str | None:
        if not isinstance(data, dict) or data.get("made_by") != _MADE_BY:
            return "not a record of `flashnext patches apply`"
        return None


def _read_record(target: Path) -> PatchRecord | None:
    """The record of the series applied to ``target``, None when there is none."""
    record_dir = target / RECORD_DIR
    if not os.path.lexists(record_dir):
        return None
    path = record_dir / RECORD_FILE
    if record_dir.is_symlink() or not record_dir.is_dir() or not os.path.lexists(path):
        raise FlashnextError(f"{record_dir} is not a record of `flashnext patches apply`; remove it yourself")
    record = validate(parse_json(read_regular_bytes(path, "a patch record", follow_symlinks=False), str(path)),
                      PatchRecord, str(path))
    for rel in record.files:
        confined(target, rel, str(path))
    return record


def _state(target: Path, record: PatchRecord) -> dict[str, str]:
    """Each recorded file: ``patched``, ``original``, or ``changed`` (neither: someone else's edit)."""
    states = {}
    for rel, entry in record.files.items():
        digest = _sha256(_read_target_file(target, rel)[0])
        states[rel] = ("patched" if digest == entry.patched_sha256
                       else "original" if digest == entry.original_sha256 else "changed")
    return states


def _original(target: Path, record: PatchRecord, rel: str) -> bytes:
    path = confined(target / RECORD_DIR / ORIGINALS, rel, str(target / RECORD_DIR / RECORD_FILE))
    data = read_regular_bytes(path, "a kept original", follow_symlinks=False)
    if _sha256(data) != record.files[rel].original_sha256:
        raise FlashnextError(f"{path}: the kept original does not match its record; reinstall vllm=={VLLM_VERSION} "
                             f"(pip install --force-reinstall) and remove {target / RECORD_DIR}")
    return data


def _remove_leftovers(target: Path, touched: set[str]) -> None:
    """What a killed ``patches apply`` left (only under its lock): its stage and partial record
    directories, by exact name and marker, and its temporary siblings of touched files."""
    for entry in os.scandir(target):
        if (_LEFTOVER.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
                and read_output_marker(Path(entry.path))):
            shutil.rmtree(entry.path)
    for rel in touched:
        path = target / rel
        if not path.parent.is_dir():
            continue
        mine = re.compile(re.escape(f".{path.name}.flashnext-") + r"[0-9]+\.tmp")
        for entry in os.scandir(path.parent):
            if mine.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)


def _staged(patches: list[Patch], originals: dict[str, bytes], modes: dict[str, int], stage: Path) -> dict[str, bytes]:
    """The touched files with the whole series applied with zero fuzz, each byte-compiled, built in
    ``stage`` from ``originals``; the target is not touched."""
    for rel, data in originals.items():
        path = confined(stage, rel, "the patch series")
        path.parent.mkdir(parents=True, exist_ok=True)
        _create_file(path, data, modes[rel])
    for patch in patches:
        _apply(patch, stage)
        for rel in patch.touches:
            _compile(patch, stage, rel, stage / "pyc" / (rel + "c"))
    return {rel: (stage / rel).read_bytes() for rel in originals}


def _already_patched_hint(error: FlashnextError, target: Path) -> FlashnextError:
    if "is applied already" in str(error):
        return FlashnextError(f"{error}, but {target} has no record of flashnext's (an older flashnext patched it "
                              f"in place): pip install --force-reinstall --no-deps vllm=={VLLM_VERSION} there, then apply again")
    return error


def apply_series(target_root: Path, series: Sequence[Patch] = SERIES) -> SeriesApplied:
    """Apply the series to the vllm under ``target_root`` (the serving image's site-packages), all
    or nothing: the touched files are patched and byte-compiled in a stage beside it, and swapped in
    only when every patch applied with zero fuzz and every file compiled. Their originals and
    hashes are kept in ``RECORD_DIR`` first, so that :func:`revert_series` can restore them and a
    rerun after an interrupted swap finishes it; a rerun on a patched tree says so. Run
    ``check_series`` first."""
    target = _target(target_root)
    patches = diffs(load_series(series))
    touched = sorted({t for p in patches for t in p.touches})
    digest = series_sha256(patches)
    with output_lock(target / RECORD_DIR):
        _remove_leftovers(target, set(touched))
        record = _read_record(target)
        if record is not None:
            return _finish_recorded(target, record, patches, digest)
        current = {rel: _read_target_file(target, rel) for rel in touched}
        originals = {rel: data for rel, (data, _) in current.items()}
        modes = {rel: st.st_mode & 0o7777 for rel, (_, st) in current.items()}
        mtimes = {rel: st.st_mtime_ns for rel, (_, st) in current.items()}
        with _marked_dir(target / f"{RECORD_DIR}.stage-{os.getpid()}") as stage:
            try:
                patched = _staged(patches, originals, modes, stage)
            except FlashnextError as e:
                raise _already_patched_hint(e, target) from None
            _write_record(target, patches, digest, originals, patched, modes, mtimes)
            swapped: list[str] = []
            try:
                for rel in touched:
                    if _sha256(_read_target_file(target, rel)[0]) != _sha256(originals[rel]):
                        raise FlashnextError(f"{target / rel}: changed while `patches apply` ran; nothing was "
                                             "patched: run it again")
                    _swap_in(target, rel, patched[rel], modes[rel])
                    swapped.append(rel)
            except BaseException:
                # Should a restore fail too, the record stays: --revert or a rerun finishes from it.
                for rel in swapped:
                    _replace_file(target / rel, originals[rel], modes[rel], mtimes[rel])
                shutil.rmtree(target / RECORD_DIR)
                raise
    return SeriesApplied([p.id for p in patches], False, target / RECORD_DIR / RECORD_FILE)


def _target(target_root: Path) -> Path:
    target = Path(target_root).absolute()
    if not (target / "vllm" / "__init__.py").is_file():
        raise FlashnextError(f"{target}: no vllm package there (pass the site-packages directory "
                             "that holds vllm/)", field="target")
    return target


@contextmanager
def _marked_dir(path: Path) -> Iterator[Path]:
    """A new directory ``path`` carrying flashnext's marker, for the block, and removed when it ends
    however it ends (a partial renamed into place is no longer there to remove)."""
    made = False
    try:
        with interrupts_held():
            path.mkdir()
            made = True
        write_marker(path, _MADE_BY)
        yield path
    finally:
        if made:
            shutil.rmtree(path, ignore_errors=True)


def _write_record(target: Path, patches: list[Patch], digest: str, originals: dict[str, bytes],
                  patched: dict[str, bytes], modes: dict[str, int], mtimes: dict[str, int]) -> None:
    """The originals and record.json, built in a partial directory and renamed into place whole."""
    with _marked_dir(target / f"{RECORD_DIR}.partial-{os.getpid()}") as partial:
        for rel, data in originals.items():
            path = confined(partial / ORIGINALS, rel, "the patch series")
            path.parent.mkdir(parents=True, exist_ok=True)
            _create_file(path, data)
        record = PatchRecord(made_by=_MADE_BY, series=[p.id for p in patches], series_sha256=digest, files={
            rel: RecordedFile(original_sha256=_sha256(originals[rel]), patched_sha256=_sha256(patched[rel]),
                              mode=modes[rel], mtime_ns=mtimes[rel]) for rel in originals})
        _create_file(partial / RECORD_FILE, (record.model_dump_json(indent=2) + "\n").encode())
        os.rename(partial, target / RECORD_DIR)
        fsync_dir(target)


def _finish_recorded(target: Path, record: PatchRecord, patches: list[Patch], digest: str) -> SeriesApplied:
    """A target with a record: already patched by this series, or an interrupted swap to finish."""
    record_file = target / RECORD_DIR / RECORD_FILE
    if record.series_sha256 != digest:
        raise FlashnextError(f"{target} is patched with another patch series ({', '.join(record.series)}; "
                             f"{record_file}): run `flashnext patches apply --target {target} --revert` first")
    states = _state(target, record)
    _refuse_changed(target, states)
    if all(state == "patched" for state in states.values()):
        return SeriesApplied(list(record.series), True, record_file)
    # An apply stopped during its swap: the rest of the files get the same patched bytes.
    originals = {rel: _original(target, record, rel) for rel in record.files}
    modes = {rel: entry.mode for rel, entry in record.files.items()}
    with _marked_dir(target / f"{RECORD_DIR}.stage-{os.getpid()}") as stage:
        patched = _staged(patches, originals, modes, stage)
        if any(_sha256(patched[rel]) != entry.patched_sha256 for rel, entry in record.files.items()):
            raise FlashnextError(f"{record_file}: the series no longer patches to the recorded bytes; run "
                                 f"`flashnext patches apply --target {target} --revert`, then apply")
        for rel, state in states.items():
            if state == "original":
                _swap_in(target, rel, patched[rel], modes[rel])
    return SeriesApplied([p.id for p in patches], False, record_file)


def _refuse_changed(target: Path, states: dict[str, str]) -> None:
    changed = [rel for rel, state in states.items() if state == "changed"]
    if changed:
        raise FlashnextError(f"{target / changed[0]}: changed since `flashnext patches apply` patched it (neither "
                             f"the original nor the patched file); reinstall vllm=={VLLM_VERSION} there (pip install "
                             f"--force-reinstall) and remove {target / RECORD_DIR}")


def series_applied(target_root: Path | None = None) -> bool:
    """Whether ``patches apply`` put this series' diffs into the vllm under ``target_root`` (default:
    the installed one): its record names this series and every recorded file is the patched one.
    Read from the record and the files' hashes, without importing vLLM (the preflight's check)."""
    target = _target(target_root if target_root is not None else installed_vllm_root())
    record = _read_record(target)
    if record is None or record.series_sha256 != series_sha256(diffs(load_series())):
        return False
    return all(state == "patched" for state in _state(target, record).values())


def revert_series(target_root: Path) -> list[str]:
    """Restore every file ``apply_series`` changed under ``target_root`` to its recorded original
    and remove the record; the files restored. A file changed since (neither the original nor the
    patched bytes) is refused before anything is restored."""
    target = _target(target_root)
    with output_lock(target / RECORD_DIR):
        record = _read_record(target)
        if record is None:
            raise FlashnextError(f"{target}: no record of `flashnext patches apply` ({target / RECORD_DIR}); "
                                 "nothing to revert")
        _remove_leftovers(target, set(record.files))
        states = _state(target, record)
        _refuse_changed(target, states)
        originals = {rel: _original(target, record, rel) for rel in record.files}
        restored = []
        for rel, state in states.items():
            if state == "patched":
                entry = record.files[rel]
                _replace_file(target / rel, originals[rel], entry.mode, entry.mtime_ns)
                restored.append(rel)
        shutil.rmtree(target / RECORD_DIR)
        fsync_dir(target)
    return restored


def _extract_wheel(wheel: Path, dest: Path) -> None:
    """The ``vllm/`` part of ``wheel`` extracted into ``dest``; a file that is no wheel is one line."""
    with open_regular(wheel, "a vllm wheel (.whl) or a vllm directory") as f:
        try:
            with zipfile.ZipFile(f) as whl:
                # ZipFile drops absolute and ".." parts of member names, so nothing lands outside dest.
                whl.extractall(dest, [n for n in whl.namelist() if n.startswith("vllm/")])
        except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, NotImplementedError, ValueError) as e:
            raise FlashnextError(f"{wheel}: not a vllm wheel or directory (not a readable zip: {e})", field="vllm") from None


def _source_tree(vllm: Path | None, tmp: Path) -> Path:
    """The directory holding the ``vllm`` package to check: installed, a directory, or a wheel
    extracted into ``tmp``."""
    if vllm is not None and not Path(vllm).is_dir():
        _extract_wheel(Path(vllm), tmp / "wheel")
        source = tmp / "wheel"
    else:
        source = Path(vllm) if vllm is not None else installed_vllm_root()
        if source.name == "vllm":  # the package directory itself rather than its parent
            source = source.parent
    if not (source / "vllm" / "__init__.py").is_file():
        raise FlashnextError(f"{source}: no vllm package there")
    return source


@dataclass(frozen=True)
class DriftRow:
    """One entry of the drift table: a patch (kept as a diff or registered as a plugin) or an
    absorbed one, and what this vllm makes of it."""

    id: str
    verdict: Literal["diff", "plugin", "absorbed"]
    status: Literal["applies", "fails", "probe failed", "registered", "absorbed", "regressed"]
    detail: str  # the refused hunk, the probe's error, or what was checked

    @property
    def ok(self) -> bool:
        return self.status in ("applies", "registered", "absorbed")

    def as_json(self) -> dict:
        return {"id": self.id, "verdict": self.verdict, "status": self.status, "ok": self.ok, "detail": self.detail}


def drift_table(vllm: Path | None = None, series: Sequence[Patch] = SERIES, absorbed: Sequence[Absorbed] = ABSORBED,
                progress: Callable[[str], None] = lambda line: None) -> list[DriftRow]:
    """What ``vllm`` (installed, a directory or a wheel; never modified) makes of every entry: each
    diff applied with zero fuzz to a shadow copy in series order (a refused one is left out, its
    hunk named, and the next goes on), byte-compiled and probed; each plugin entry's probe run
    after vLLM's own plugin loading; each absorbed patch's probe of upstream's fix. One row an
    entry; the probes share one interpreter that imports the shadow tree."""
    patches = load_series(series)
    with scratch_directory("patches", _CHECKED_BY) as tmp:
        source = _source_tree(vllm, tmp)
        root = tmp / "tree"
        _shadow_tree(source, {t for p in diffs(patches) for t in p.touches}, root)
        refused: dict[str, str] = {}
        for i, patch in enumerate(diffs(patches), 1):
            before = {rel: (root / rel).read_bytes() for rel in patch.touches if (root / rel).is_file()}
            try:
                _apply(patch, root)
                for rel in patch.touches:
                    _compile(patch, root, rel, tmp / "pyc" / (rel + "c"))
            except FlashnextError as e:
                for rel, data in before.items():  # a refused patch leaves no hunk behind
                    (root / rel).write_bytes(data)
                refused[patch.id] = str(e)
                progress(f"[{i}] {patch.id}: {e}")
            else:
                progress(f"[{i}] {patch.id}: applied with zero fuzz, compiled")
        probed = [p for p in patches if p.id not in refused]
        progress(f"probing {len(probed) + len(absorbed)} entries in one interpreter (it imports vLLM first) ...")
        failures = _run_probes([*probed, *absorbed], root, tmp, progress)
    rows = []
    for p in patches:
        if p.id in refused:
            rows.append(DriftRow(p.id, p.verdict, "fails", refused[p.id]))
        elif p.id in failures:
            rows.append(DriftRow(p.id, p.verdict, "probe failed", failures[p.id]))
        elif p.verdict == "plugin":
            rows.append(DriftRow(p.id, "plugin", "registered", f"registered by {p.registers}"))
        else:
            rows.append(DriftRow(p.id, "diff", "applies", f"zero fuzz; compiled {', '.join(p.touches)}; probe passed"))
    for a in absorbed:
        rows.append(DriftRow(a.id, "absorbed", "regressed" if a.id in failures else "absorbed",
                             f"upstream's fix not found: {failures[a.id]}" if a.id in failures
                             else f"upstream since {a.since}: {a.fixed_by}"))
    return rows


def check_series(vllm: Path | None = None, series: Sequence[Patch] = SERIES,
                 progress: Callable[[str], None] = lambda line: None) -> list[dict]:
    """The series checked against ``vllm`` (:func:`drift_table` for the series alone): one result
    a patch; the first entry that does not apply or probe raises, naming it (and how many more)."""
    rows = drift_table(vllm, series, absorbed=(), progress=progress)
    # a refused hunk first: it is what to port, and probes after it fail for want of it
    bad = sorted((r for r in rows if not r.ok), key=lambda r: r.status != "fails")
    if bad:
        first, *others = bad
        more = f" (and {len(others)} more failed: {', '.join(r.id for r in others)})" if others else ""
        if first.status == "fails":
            raise FlashnextError(f"{first.detail}{more}")
        raise FlashnextError(f"patch {first.id} applied but its probe failed: {first.detail}{more}")
    by_id = {p.id: p for p in series}
    return [{"id": r.id, "verdict": r.verdict, "applied": r.verdict == "diff", "compiled": list(by_id[r.id].touches),
             "probe": "passed"} for r in rows]


def probe_tree(root: Path | None = None, series: Sequence[Patch] = SERIES) -> dict[str, str]:
    """Every probe of the series against the vLLM under ``root`` (default: the installed one, as the
    serving image has it patched at build): the failed ones, by id, in series order. The same runner
    as ``check_series``'s, so the selftest and the check cannot disagree on what a probe means."""
    patches = load_series(series)
    root = Path(root) if root is not None else installed_vllm_root()
    with scratch_directory("probes", _CHECKED_BY) as tmp:
        return _run_probes(patches, root.resolve(), tmp)


def _probe_env(root: Path) -> dict[str, str]:
    """The probe interpreter's environment: the shadow tree first on its path, no GPU unless one is
    visible here, no bytecode written next to the tree's symlinked sources."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *sys.path[1:]]), PYTHONDONTWRITEBYTECODE="1",
                CUDA_VISIBLE_DEVICES=envs.CUDA_VISIBLE_DEVICES.get())


PROBE_TIMEOUT_S = 600


def _finished_events(events_file: Path, seen: int, progress: Callable[[str], None]) -> int:
    """Report each probe that finished since the first ``seen`` event lines (only whole lines:
    the runner may be writing the next); returns how many lines are seen now."""
    lines = events_file.read_text().split("\n")[:-1]
    for line in lines[seen:]:
        e = json.loads(line)
        if "id" in e:
            progress(f"probe {e['id']}: {'passed' if e['error'] is None else 'FAILED: ' + e['error']}")
    return len(lines)


def _run_probes(patches: list[Patch], root: Path, tmp: Path,
                progress: Callable[[str], None] = lambda line: None) -> dict[str, str]:
    """Every patch's probe in one interpreter that imports ``root``; the failed ones, by id, with
    their last error line (in series order). ``progress`` hears of each probe as it finishes."""
    probes_file, events_file = tmp / "probes.json", tmp / "probe-events.jsonl"
    calls = probe_calls(patches)
    probes_file.write_text(json.dumps([[p.id, calls[p.id][0].__module__, calls[p.id][0].__name__, list(calls[p.id][1]),
                                        list(p.touches)] for p in patches]))
    events_file.write_text("")
    seen = 0
    # stderr to a file, not a pipe: nothing reads a pipe while the events are followed
    with open(tmp / "probe-stderr.txt", "w+") as stderr:
        runner = [sys.executable, "-m", probe_runner.__name__, str(root), str(probes_file), str(events_file)]
        proc = subprocess.Popen(runner, stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=_probe_env(root),
                                cwd=tmp)
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                seen = _finished_events(events_file, seen, progress)
                time.sleep(0.25)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        _finished_events(events_file, seen, progress)
        stderr.seek(0)
        if time.monotonic() >= deadline and proc.returncode < 0:
            crashed = f"the probe interpreter ran for more than {PROBE_TIMEOUT_S} s"
        else:
            crashed = (stderr.read().strip().splitlines() or [f"the probe interpreter exited with {proc.returncode}"])[-1]
    events = [json.loads(line) for line in events_file.read_text().splitlines() if line.strip()]
    failures: dict[str, str] = {}
    for e in events:
        if "fatal" in e:
            raise FlashnextError(f"the patch probes could not start: {e['fatal']}")
        if "id" in e and e["error"] is not None:
            failures[e["id"]] = e["error"]
    finished = {e["id"] for e in events if "id" in e}
    started = [e["start"] for e in events if "start" in e]
    for p in patches:  # the interpreter died: the probe it was in, and every one after it
        if p.id not in finished:
            failures[p.id] = crashed if started and p.id == started[-1] else "not run: an earlier probe ended the interpreter"
    return {p.id: failures[p.id] for p in patches if p.id in failures}
