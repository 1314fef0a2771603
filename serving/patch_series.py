"""The vLLM patch series: ``serving/patches/series.json`` and its zero-fuzz check.

Each patch is a unified diff against vllm==0.33.0 with, in the series file, its order, id, what it
fixes and the seed's measured effect, the env switch that turns it off, the files it touches, the
library hook it calls, a probe that proves it applied, and its upstream status.

``check`` never touches the installed package. It builds a shadow tree: every entry of the
installed ``vllm`` is symlinked except along the touched paths, where directories are recreated
and the touched files copied. It applies the series there with ``patch --fuzz=0`` (the first
refused hunk is named), byte-compiles every touched file, and runs every probe in one fresh
interpreter that imports the patched tree (it first makes sure ``vllm`` comes from the shadow
tree; each probe runs in its own namespace and is reported by its patch's id). ``--vllm`` may also
name another vllm directory or a vllm wheel.
"""

from __future__ import annotations

import json
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from flashnext.errors import FlashnextError

PATCH_DIR = Path(__file__).resolve().parent / "patches"
SERIES_FILE = PATCH_DIR / "series.json"
_FIELDS = ("order", "id", "file", "fixes", "details", "seed_effect", "env_switch", "touches", "hook", "probe",
           "upstream", "test")
README_FILE = PATCH_DIR / "README.md"
TABLE_BEGIN = "<!-- the table is generated from series.json: flashnext patches readme --write -->"
TABLE_END = "<!-- end of the generated table -->"


@dataclass(frozen=True)
class Patch:
    order: int
    id: str
    file: str
    fixes: str  # one sentence, for `patches list`
    details: str  # the README's account
    seed_effect: str
    env_switch: str
    touches: tuple[str, ...]
    hook: str
    probe: str
    upstream: str
    test: str

    @property
    def path(self) -> Path:
        return PATCH_DIR / self.file


def load_series(series_file: Path = SERIES_FILE) -> list[Patch]:
    data = json.loads(Path(series_file).read_text())
    patches = []
    for entry in data["patches"]:
        unknown, missing = set(entry) - set(_FIELDS), set(_FIELDS) - set(entry)
        if unknown or missing:
            raise FlashnextError(f"{series_file}: patch {entry.get('id')}: unknown {sorted(unknown)}, missing {sorted(missing)}")
        patches.append(Patch(**{**entry, "touches": tuple(entry["touches"])}))
    patches.sort(key=lambda p: p.order)
    for p in patches:
        touched = {line.split()[1][2:] for line in p.path.read_text().splitlines() if line.startswith("+++ ")}
        if touched != set(p.touches):
            raise FlashnextError(f"{p.id}: the series says it touches {sorted(p.touches)}, the diff touches {sorted(touched)}")
    return patches


def readme_table(patches: list[Patch]) -> str:
    """The patches README's table, one row a patch, from the series."""
    rows = ["| order | id | fixes | seed 000's measured effect | off switch | test |", "|---|---|---|---|---|---|"]
    for p in patches:
        cells = [str(p.order), p.id, p.details, p.seed_effect, f"`{p.env_switch}`", p.test]
        rows.append("| " + " | ".join(cell.replace("\n", " ") for cell in cells) + " |")
    return "\n".join(rows)


def readme_with_table(readme: str, patches: list[Patch]) -> str:
    """``readme`` with the text between its table markers replaced by :func:`readme_table`."""
    head, sep, rest = readme.partition(TABLE_BEGIN + "\n")
    _, sep2, tail = rest.partition(TABLE_END)
    if not sep or not sep2:
        raise FlashnextError(f"{README_FILE}: the table markers are missing")
    return head + TABLE_BEGIN + "\n" + readme_table(patches) + "\n" + TABLE_END + tail


def installed_vllm_root() -> Path:
    """The directory holding the installed ``vllm`` package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise FlashnextError("vllm is not installed here: pip install 'flashnext[serve]', or pass --vllm PATH")
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
        failed = [line for line in (out.stdout + out.stderr).splitlines() if "FAILED" in line or "can't find" in line]
        raise FlashnextError(f"patch {patch.id} does not apply with zero fuzz to this vllm: "
                             f"{failed[0] if failed else (out.stdout + out.stderr).strip().splitlines()[-1]}")


def patched_tree(dest: Path, series_file: Path = SERIES_FILE) -> Path:
    """The installed vLLM with the whole series applied, as a shadow tree at ``dest`` (put it first
    on PYTHONPATH). The installed package is not touched."""
    patches = load_series(series_file)
    _shadow_tree(installed_vllm_root(), {t for p in patches for t in p.touches}, Path(dest))
    for p in patches:
        _apply(p, Path(dest))
    return Path(dest)


def apply_series(target_root: Path, series_file: Path = SERIES_FILE) -> list[str]:
    """Apply the series in place to the vllm under ``target_root`` (the serving image's
    site-packages) and byte-compile the touched files. Run ``check_series`` first."""
    patches = load_series(series_file)
    for patch in patches:
        _apply(patch, Path(target_root))
        for rel in patch.touches:
            py_compile.compile(str(Path(target_root) / rel), doraise=True)
    return [p.id for p in patches]


def check_series(vllm: Path | None = None, series_file: Path = SERIES_FILE) -> list[dict]:
    """Apply the series to a shadow copy of ``vllm`` (installed, a directory, or a wheel), compile
    and probe it. Returns one result per patch; a drifted hunk raises with its name."""
    patches = load_series(series_file)
    with tempfile.TemporaryDirectory(prefix="flashnext-patches-") as tmp:
        tmp = Path(tmp)
        if vllm is not None and str(vllm).endswith(".whl"):
            with zipfile.ZipFile(vllm) as whl:
                whl.extractall(tmp / "wheel", [n for n in whl.namelist() if n.startswith("vllm/")])
            source = tmp / "wheel"
        else:
            source = Path(vllm) if vllm is not None else installed_vllm_root()
            if source.name == "vllm":  # the package directory itself rather than its parent
                source = source.parent
        if not (source / "vllm" / "__init__.py").is_file():
            raise FlashnextError(f"{source}: no vllm package there")
        root = tmp / "tree"
        _shadow_tree(source, {t for p in patches for t in p.touches}, root)
        results = []
        for patch in patches:
            _apply(patch, root)
            for rel in patch.touches:
                try:
                    py_compile.compile(str(root / rel), cfile=str(tmp / "pyc" / (rel + "c")), doraise=True)
                except py_compile.PyCompileError as e:
                    raise FlashnextError(f"patch {patch.id}: {rel} no longer compiles: {e.msg.strip().splitlines()[-1]}") from None
            results.append({"id": patch.id, "applied": True, "compiled": list(patch.touches)})
        failures = _run_probes(patches, root, tmp)
        for patch, result in zip(patches, results):
            if patch.id not in failures:
                result["probe"] = "passed"
        if failures:
            (first, error), *others = failures.items()
            more = f" (and {len(others)} more failed: {', '.join(pid for pid, _ in others)})" if others else ""
            raise FlashnextError(f"patch {first} applied but its probe failed: {error}{more}")
        return results


# Runs in the interpreter that imports the shadow tree: argv is the tree, a JSON file of
# [[id, probe, touched files]], and the file it appends one JSON line to per event. Probes
# share the interpreter (one vLLM import instead of one per patch) but not their namespaces.
_PROBE_RUNNER = r'''
import importlib, json, linecache, os, sys, traceback
root, probes_file, events_file = sys.argv[1:4]
events = open(events_file, "a")

def event(**fields):
    events.write(json.dumps(fields) + "\n")
    events.flush()

def last_error_line(exc):
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith("<probe ")]
    where = f" (probe line {frames[-1].lineno}: {frames[-1].line})" if frames and frames[-1].line else ""
    return traceback.format_exception_only(type(exc), exc)[-1].strip() + where

try:
    import vllm
    origin = os.path.abspath(vllm.__file__)
    if not origin.startswith(os.path.join(root, "vllm") + os.sep):
        raise ImportError(f"the probes import vllm from {origin}, not from the patched shadow tree {root}")
except BaseException as exc:
    event(fatal=last_error_line(exc))
    sys.exit(1)
for patch_id, probe, touched in json.load(open(probes_file)):
    event(start=patch_id)
    filename = f"<probe {patch_id}>"
    linecache.cache[filename] = (len(probe), None, probe.splitlines(True), filename)
    try:
        exec(compile(probe, filename, "exec"), {"__name__": "__probe__"})
        for rel in touched:  # a touched module the probe imported must be the tree's patched copy
            module = sys.modules.get(rel[:-len(".py")].replace("/", ".").removesuffix(".__init__"))
            if module is not None and os.path.abspath(module.__file__) != os.path.join(root, rel):
                raise ImportError(f"{module.__name__} was imported from {module.__file__}, not the shadow tree")
    except BaseException as exc:
        event(id=patch_id, error=last_error_line(exc))
    else:
        event(id=patch_id, error=None)
'''


def _probe_env(root: Path) -> dict[str, str]:
    """The probe interpreter's environment: the shadow tree first on its path, no GPU unless one is
    visible here, no bytecode written next to the tree's symlinked sources."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *sys.path[1:]]), PYTHONDONTWRITEBYTECODE="1",
                CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""))


def _run_probes(patches: list[Patch], root: Path, tmp: Path) -> dict[str, str]:
    """Every patch's probe in one interpreter that imports ``root``; the failed ones, by id, with
    their last error line (in series order)."""
    probes_file, events_file = tmp / "probes.json", tmp / "probe-events.jsonl"
    probes_file.write_text(json.dumps([[p.id, p.probe, list(p.touches)] for p in patches]))
    events_file.write_text("")
    try:
        run = subprocess.run([sys.executable, "-c", _PROBE_RUNNER, str(root), str(probes_file), str(events_file)],
                             capture_output=True, text=True, env=_probe_env(root), cwd=tmp, timeout=600)
        crashed = (run.stderr.strip().splitlines() or [f"the probe interpreter exited with {run.returncode}"])[-1]
    except subprocess.TimeoutExpired:
        crashed = "the probe interpreter ran for more than 600 s"
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
