"""The hostile-input suite's harness: a private work tree per case, header surgery, the command
lines, and the one-line check. Each module of ``tests/hostile/`` is one class of attack, table-driven.

Each case gets a private work tree: ``snap`` (a copy of the demo snapshot), ``ov`` (an mtp-int4
overlay of it) and ``table.bin`` (its PLE table file with sidecar); the case breaks one thing and
returns the command line.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from click.testing import CliRunner

from flashnext.tools.cli import main as cli

MTP_SHARD = "model-00005-of-00005.safetensors"
FIRST_SHARD = "model-00001-of-00005.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass
class Work:
    root: Path

    @property
    def snap(self) -> Path:
        return self.root / "snap"

    @property
    def ov(self) -> Path:
        return self.root / "ov"

    @property
    def table(self) -> Path:
        return self.root / "table.bin"

    def edit_json(self, path: Path, edit: Callable[[object], object]) -> None:
        """Edit the document in place, or replace it whole when ``edit`` returns :class:`Whole`."""
        data = json.loads(path.read_text())
        result = edit(data)
        path.write_text(json.dumps(result.value if isinstance(result, Whole) else data))


@dataclass(frozen=True)
class Whole:
    value: object


def tree_state(root: Path, modes: bool = False) -> dict[str, tuple]:
    """Every entry under ``root``: directories, link targets, FIFOs as such (never opened) and file
    hashes; with ``modes``, each directory's and file's mode too (for byte-identity of a tree)."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            mode = (st.st_mode,) if modes else ()
            if stat.S_ISLNK(st.st_mode):
                state[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                state[rel] = ("dir", *mode)
            elif stat.S_ISFIFO(st.st_mode):
                state[rel] = ("fifo",)
            else:
                state[rel] = ("file", *mode, hashlib.sha256(p.read_bytes()).hexdigest())
    return state


# what two uninterrupted runs write differently: how long they took, how fast, a file's identity
TIMINGS = {"seconds", "mtime_ns", "inode"}


def untimed(value):
    """A JSON document without its timings (:data:`TIMINGS`, and every ``*_per_s`` rate)."""
    if isinstance(value, dict):
        return {k: untimed(v) for k, v in value.items() if k not in TIMINGS and not k.endswith("_per_s")}
    if isinstance(value, list):
        return [untimed(v) for v in value]
    return value


def output_state(path: Path) -> dict:
    """The output's files (a file output: it and its sidecar) and their bytes; a JSON document's
    content without its timings: what two uninterrupted runs of a writer make alike."""
    files = sorted(path.rglob("*")) if path.is_dir() else [path, path.with_name(path.name + ".json")]
    state = {}
    for f in files:
        if f.is_symlink():
            state[str(f.relative_to(path.parent))] = ("link", os.readlink(f))
        elif f.is_file():
            data = f.read_bytes()
            state[str(f.relative_to(path.parent))] = untimed(json.loads(data)) if f.suffix == ".json" else data
    return state


def modes_bind() -> bool:
    """Whether file modes stop this process: a file of mode 000 cannot be read (root reads it, unless
    it runs without CAP_DAC_OVERRIDE, as ``setpriv --bounding-set=-dac_override,-dac_read_search``)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        probe = Path(d) / "probe"
        probe.write_bytes(b"x")
        probe.chmod(0)
        try:
            probe.read_bytes()
        except PermissionError:
            return True
        return False


# --- safetensors header surgery -------------------------------------------------------------------

def read_raw(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(path: Path, header: dict | bytes, data: bytes) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(path: Path, edit: Callable[[dict], None]) -> None:
    header, data = read_raw(path)
    edit(header)
    write_raw(path, header, data)


def tensors_by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def negative_offset(h):
    first = tensors_by_offset(h)[0]
    h[first]["data_offsets"][0] = -8


def reversed_offsets(h):
    last = tensors_by_offset(h)[-1]
    h[last]["data_offsets"].reverse()


def overlapping_offsets(h):
    a, b = tensors_by_offset(h)[:2]
    size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
    h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size]


def non_string_metadata(h):
    h["__metadata__"] = {"format": 1}


def unknown_dtype(h):
    h[tensors_by_offset(h)[0]]["dtype"] = "Q3"


def shape_disagrees_with_bytes(h):
    h[tensors_by_offset(h)[-1]]["shape"] = [1, 1]


def header_not_an_object(path: Path) -> None:
    write_raw(path, b"[1, 2, 3]", b"")


def duplicate_tensor_names(path: Path) -> None:
    header, data = read_raw(path)
    first = tensors_by_offset(header)[0]
    text = json.dumps(header)
    entry = json.dumps({first: header[first]})[1:-1]
    write_raw(path, (text[:-1] + ", " + entry + "}").encode(), data)


def trailing_bytes(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 8)


def truncated(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 8)


def huge_header_length(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])


# --- the cases ------------------------------------------------------------------------------------

def mtp(w: Work, *extra: str) -> list[str]:
    return ["make-mtp-int4", "--src", str(w.snap), "--out", str(w.root / "out"), "--no-progress", *extra]


def repack(w: Work, *extra: str) -> list[str]:
    return ["repack-int6", "--src", str(w.snap), "--out", str(w.root / "out"), *extra]


def apply(w: Work, *extra: str, out: Path | None = None) -> list[str]:
    return ["overlay", "apply", str(w.ov), "--base", str(w.snap), "--out", str(out or w.root / "out"), *extra]


def shard_name(name: str) -> Callable[[Work], list[str]]:
    """The index names ``name`` as the MTP shard's file."""
    def setup(w: Work) -> list[str]:
        def edit(index):
            for k, v in index["weight_map"].items():
                if v == MTP_SHARD:
                    index["weight_map"][k] = name
        w.edit_json(w.snap / INDEX, edit)
        return mtp(w)
    return setup


def header_case(edit: Callable, shard: str = MTP_SHARD, command=mtp) -> Callable[[Work], list[str]]:
    def setup(w: Work) -> list[str]:
        path = w.snap / shard
        if edit.__code__.co_varnames[:1] == ("h",):
            edit_header(path, edit)
        else:
            edit(path)
        return command(w)
    return setup


def json_case(file: Callable[[Work], Path], edit: Callable[[object], object],
              command: Callable[[Work], list[str]]) -> Callable[[Work], list[str]]:
    """Edit one JSON file of the work tree, then run ``command``."""
    def setup(w: Work) -> list[str]:
        w.edit_json(file(w), edit)
        return command(w)
    return setup


def manifest_case(edit, command):
    return json_case(lambda w: w.ov / "overlay.json", edit, command)


def adds(path: str):
    def edit(m):
        m["adds"].append({"path": path, "sha256": "0" * 64, "size": 0})
    return edit


def config_case(edit, command=mtp, file: str = "config.json"):
    return json_case(lambda w: w.snap / file, edit, command)


def text(key: str, value):
    def edit(c):
        c["text_config"][key] = value
    return edit


def sidecar_case(edit, command):
    return json_case(lambda w: w.root / "table.bin.json", edit, command)


def ple_verify(w: Work) -> list[str]:
    return ["ple", "verify", str(w.table)]


def ple_build(w: Work, *extra: str) -> list[str]:
    return ["ple", "build", "--src", str(w.snap), "--out", str(w.root / "new.bin"), "--no-progress", *extra]


def view_record_case(edit: Callable[[dict], object]):
    def setup(w: Work) -> list[str]:
        view = w.root / "view"
        assert CliRunner().invoke(cli, apply(w, out=view)).exit_code == 0
        w.edit_json(view / ".flashnext-view.json", edit)
        return ["overlay", "verify", str(view)]
    return setup


def unrelated_folder(w: Work) -> Path:
    folder = w.root / "my-data"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    return folder


@dataclass(frozen=True)
class Case:
    id: str
    setup: Callable[[Work], list[str]]
    message: str
    exit_code: int = 1


def invoke_expecting_one_line(argv: list[str]):
    result = CliRunner().invoke(cli, argv)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return result, lines[0]




def assert_refused(case: Case, work: Work, first: str = "Error: ") -> None:
    """Run ``case``: one line starting ``first`` that names ``case.message``, ``case.exit_code``, and
    the whole work tree (source snapshot included) byte-for-byte as it was."""
    argv = case.setup(work)
    before = tree_state(work.root)
    result, line = invoke_expecting_one_line(argv)
    assert result.exit_code == case.exit_code, line
    assert line.startswith(first) and case.message in line, line
    assert tree_state(work.root) == before, "the command wrote or removed something"


def interrupt_ple_build(work: Work, monkeypatch, at_shard: int = 1) -> None:
    """``ple build`` stopped (as by Ctrl-C) just before copying shard ``at_shard``: its partial file
    and journal stay for a resume."""
    import flashnext.quant.ple.table as mod

    real = mod._copy_shard

    def interrupted(shard, *a, **k):
        if shard.index == at_shard:
            raise KeyboardInterrupt
        return real(shard, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(mod, "_copy_shard", interrupted)
        assert CliRunner().invoke(cli, ple_build(work)).exit_code == 130
    assert (work.root / "new.bin.partial").is_file() and (work.root / "new.bin.partial.json").is_file()
