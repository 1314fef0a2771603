"""Issue 26, class 7 (and class 6's profile and wheel items): inputs that are not regular files, a
catastrophic regular expression in the config, a source rewritten while it is read, a profile
that is not JSON, a ``--vllm`` that is not a wheel. Each ends in one line and exit 1, quickly, and
writes nothing. A case that would hang on a FIFO or a backtracking regex is stopped by a
``SIGALRM`` guard (a :class:`Hung` escapes every handler, so the case fails rather than hangs).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from flashnext.errors import FlashnextError
from flashnext.tools.cli import main as cli
from support.hostile import INDEX, MTP_SHARD, Case, Work, apply, invoke_expecting_one_line, mtp, repack, tree_state

GUARD_S = 20  # far beyond what a refusal takes; what a hang would exceed


class Hung(BaseException):
    """Raised by the guard's alarm: not an Exception, so no error handler turns it into an exit code."""


@contextlib.contextmanager
def hang_guard(seconds: float = GUARD_S):
    def expired(signum, frame):
        raise Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def fifo_at(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def fifo_case(file: Callable[[Work], Path], command: Callable[[Work], list[str]]) -> Callable[[Work], list[str]]:
    def setup(w: Work) -> list[str]:
        fifo_at(file(w))
        return command(w)
    return setup


def fifo_wheel(w: Work) -> list[str]:
    return ["patches", "check", "--vllm", str(fifo_at(w.root / "vllm-0.33.0-py3-none-any.whl"))]


def not_a_wheel(w: Work) -> list[str]:
    (w.root / "vllm-0.33.0-py3-none-any.whl").write_text("not a zip")
    return ["patches", "check", "--vllm", str(w.root / "vllm-0.33.0-py3-none-any.whl")]


def ignore_pattern(pattern: str) -> Callable[[Work], list[str]]:
    def setup(w: Work) -> list[str]:
        w.edit_json(w.snap / "config.json", lambda c: (c.get("quantization_config") or c["text_config"][
            "quantization_config"])["ignore"].append(pattern))
        return mtp(w)
    return setup


# A pattern whose backtracking on one MTP expert name (37 characters) takes longer than the universe.
CATASTROPHIC = r"re:(?:[a-z._0-9]+)+!"

CASES = [
    # Non-regular inputs: each would block open() until a writer came.
    Case("fifo-config", fifo_case(lambda w: w.snap / "config.json", mtp), "is a FIFO, not a regular file"),
    Case("fifo-index", fifo_case(lambda w: w.snap / INDEX, mtp), "is a FIFO, not a regular file"),
    Case("fifo-index-repack", fifo_case(lambda w: w.snap / INDEX, repack), "is a FIFO, not a regular file"),
    Case("fifo-overlay-config", fifo_case(lambda w: w.ov / "config.json", lambda w: apply(w, "--no-verify")),
         "is a FIFO, not a regular file"),
    Case("fifo-vllm-wheel", fifo_wheel, "is a FIFO, not a regular file"),
    # class 6: a --vllm file that is no wheel is bad input, not a flashnext bug
    Case("vllm-not-a-wheel", not_a_wheel, "not a vllm wheel or directory"),
    # A catastrophic regular expression in the config's ignore list.
    Case("ignore-catastrophic-regex", ignore_pattern(CATASTROPHIC), "quantifier inside a repeated group"),
    Case("ignore-alternation-in-repeat", ignore_pattern(r"re:(?:mtp|m|t|p|\.|[a-z_0-9])+!"),
         "alternation inside a repeated group"),
    Case("ignore-invalid-regex", ignore_pattern("re:("), "not a valid regular expression"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_misc_input(case: Case, work: Work):
    argv = case.setup(work)
    before = tree_state(work.root)
    started = time.monotonic()
    with hang_guard():
        result, line = invoke_expecting_one_line(argv)
    assert result.exit_code == 1, line
    assert line.startswith("Error: ") and case.message in line, line
    assert time.monotonic() - started < GUARD_S / 2
    assert tree_state(work.root) == before, "the command wrote or removed something"


# --- the readers themselves, for inputs that no command reaches through a FIFO today ---------------

def _profile_dir(tmp_path: Path, content: Callable[[Path], None]) -> Path:
    content(tmp_path / "3x3090.json")
    return tmp_path


PROFILE = Path(__file__).resolve().parents[2] / "serving" / "profiles" / "3x3090.json"


def _profile_edit(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        data = json.loads(PROFILE.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return write


READER_CASES = [
    ("profile-fifo", lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),
    ("profile-dev-null", lambda p: p.symlink_to("/dev/null"), "is a character device, not a regular file"),
    ("profile-not-json", lambda p: p.write_text("name: 3x3090\n"), "not valid JSON"),
    ("profile-nan", lambda p: p.write_text(PROFILE.read_text().replace('"gpus": 3', '"gpus": NaN')), "not valid JSON"),
    ("profile-array", lambda p: p.write_text("[]"), "must be a JSON object"),
    ("profile-container-int", _profile_edit(lambda d: d.update(container=5)), "container must be a JSON object"),
    ("profile-gpus-string", _profile_edit(lambda d: d.update(gpus="3")), "gpus must be an integer"),
    ("profile-args-not-strings", _profile_edit(lambda d: d.update(vllm_args=[1, 2])), "vllm_args must be a list"),
    ("profile-env-not-strings", _profile_edit(lambda d: d["env"].update(X=1)), "env must be an object of strings"),
    ("profile-port-bool", _profile_edit(lambda d: d["container"].update(port=True)), "port must be an integer"),
]


@pytest.mark.parametrize("make, message", [c[1:] for c in READER_CASES], ids=[c[0] for c in READER_CASES])
def test_a_bad_profile_is_one_line(make, message, tmp_path):
    from flashnext.serving.profiles import load_profile

    directory = _profile_dir(tmp_path, make)
    with hang_guard(), pytest.raises(FlashnextError, match=message):
        load_profile("3x3090", directory)


def _io():
    import flashnext.quant.formats.safetensors_io as io

    return io


SHARD_READERS = {
    "header": lambda path, header: _io().read_header(path),
    "rows": lambda path, header: _io().read_rows(path, next(iter(header.entries.values())), 0, 1),
}


@pytest.mark.parametrize("reader", sorted(SHARD_READERS))
def test_a_fifo_shard_is_refused_by_the_shard_readers(reader, work):
    path = work.snap / MTP_SHARD
    header = _io().read_header(path)
    fifo_at(path)
    with hang_guard(), pytest.raises(FlashnextError, match="is a FIFO, not a regular file"):
        SHARD_READERS[reader](path, header)


# --- a bounded matcher: compressed-tensors' semantics for normal patterns --------------------------

def test_the_ignore_matcher_is_bounded_and_keeps_compressed_tensors_semantics():
    from compressed_tensors.utils.match import match_name

    from flashnext.quant.formats.ct_config import MTP_EXPERT_TARGET, MTP_OTHER_IGNORE, matches

    names = ["mtp.layers.0.mlp.experts.0.gate_proj", "mtp.layers.48.mlp.shared_expert.down_proj", "lm_head",
             "model.layers.3.mlp.gate", "model.visual.blocks.0.attn.qkv"]
    normal = ["lm_head", "re:.*lm_head", r"re:.*mlp\.gate$", "re:model.visual.*", r"re:.*(gate|up)_proj",
              MTP_EXPERT_TARGET, MTP_OTHER_IGNORE, "re:^mtp", r"re:(?:\d{2})+"]
    for entry in normal:
        for name in names:
            assert matches(name, entry) == match_name(name, entry), (entry, name)
    started = time.monotonic()
    with hang_guard(5):
        for entry in (CATASTROPHIC, "re:(a+)+$", "re:(a?){30}a{30}", "re:" + ".*" * 8 + "!", "re:" + "a" * 600):
            with pytest.raises(FlashnextError, match="exponential time"):
                matches(names[0], entry)
    assert time.monotonic() - started < 1.0


# --- a source rewritten while it is read ---------------------------------------------------------

def rewrite_in_place(path: Path) -> None:
    """Same inode, same size, other bytes (a later clock tick than the copy's preserved mtime)."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def replace_by_rename(path: Path) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(path.read_bytes())
    os.replace(tmp, path)


def truncate_by_one(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


REWRITES = {"in-place": rewrite_in_place, "replaced": replace_by_rename, "truncated": truncate_by_one}
READS = [  # the command, and the module whose reads of a source tensor the hook follows
    ("mtp-rows", mtp, "flashnext.quant.overlays.mtp_int4.source", "read_rows"),
    ("mtp-copy", mtp, "flashnext.quant.overlays.builder", "copy_tensor_bytes"),
    ("repack-rows", repack, "flashnext.quant.overlays.int6_repack", "read_rows"),
]


@pytest.mark.parametrize("rewrite", sorted(REWRITES))
@pytest.mark.parametrize("command, module, function", [r[1:] for r in READS], ids=[r[0] for r in READS])
def test_a_source_rewritten_while_read_is_refused(command, module, function, rewrite, work, monkeypatch):
    import importlib

    mod = importlib.import_module(module)
    real = getattr(mod, function)
    rewritten: list[Path] = []

    def read_then_rewrite(source, *args, **kwargs):
        result = real(source, *args, **kwargs)
        if not rewritten:  # someone rewrites the source just after flashnext's first read of it
            REWRITES[rewrite](Path(source))
            rewritten.append(Path(source))
        return result

    monkeypatch.setattr(mod, function, read_then_rewrite)
    before = tree_state(work.root)
    result, line = invoke_expecting_one_line(command(work))
    assert rewritten, "the hook never ran"
    assert result.exit_code == 1 and "while flashnext was reading it; nothing was written" in line, line
    changed = str(rewritten[0].relative_to(work.root))
    after = tree_state(work.root)
    assert {k: v for k, v in after.items() if k != changed} == {k: v for k, v in before.items() if k != changed}


# --- follow-ups: every reader refuses what is no regular file; sources re-checked before the rename -

PLE_SHARD = "model-00003-of-00005.safetensors"  # the demo's PLE table shards
REWRITTEN_BY_REPACK = "model-00001-of-00005.safetensors"  # holds shared experts repack-int6 rewrites


def fifo_calib(w: Work) -> list[str]:
    return mtp(w, "--calib", str(fifo_at(w.root / "calib.safetensors")))


def ple_verify(w: Work) -> list[str]:
    return ["ple", "verify", str(w.table)]


def overlay_verify(w: Work) -> list[str]:
    return ["overlay", "verify", str(w.ov), "--base", str(w.snap)]


def repack_quietly(w: Work) -> list[str]:
    return repack(w, "--no-progress")


def ple_build(w: Work) -> list[str]:
    return ["ple", "build", "--src", str(w.snap), "--out", str(w.root / "new.bin"), "--no-progress"]


FIFO_READER_CASES = [
    Case("fifo-calib", fifo_calib, "is a FIFO, not a regular file"),
    Case("fifo-ple-table", fifo_case(lambda w: w.table, ple_verify), "is a FIFO, not a regular file"),
    Case("fifo-ple-sidecar", fifo_case(lambda w: w.root / "table.bin.json", ple_verify),
         "is a FIFO, not a regular file"),
    Case("fifo-overlay-manifest", fifo_case(lambda w: w.ov / "overlay.json", overlay_verify),
         "is a FIFO, not a regular file"),
    Case("fifo-shard-in-snapshot", fifo_case(lambda w: w.snap / PLE_SHARD, mtp), "is a FIFO, not a regular file"),
]


@pytest.mark.parametrize("case", FIFO_READER_CASES, ids=[c.id for c in FIFO_READER_CASES])
def test_every_reader_refuses_a_fifo_as_what_it_is(case: Case, work: Work):
    test_hostile_misc_input(case, work)


def _sha256_file(path: Path):
    from flashnext.quant.checkpoint.fsutil import sha256_file

    return sha256_file(path)


def _table_mapping(path: Path):
    from flashnext.quant.ple.prefetch import TableMapping

    return TableMapping(path, 1)


def _drive_check(path: Path):
    from flashnext.quant.ple.drive import drive_check

    return drive_check(path, seconds=0.1)


def _selftest_report(path: Path):
    from flashnext.serving.selftest.report import load_report

    return load_report(path)


def _selftest_tokenizer(path: Path):
    from flashnext.serving.selftest.tokenizer import write_tokenizer

    return write_tokenizer(path.parent)


def _capacity_config(path: Path):
    from flashnext.serving.capacity import load_text_config

    return load_text_config(path.parent)


# Readers that no command above reaches with a FIFO: each, given one, refuses it instead of blocking
# in open() (the guard fails the case) or calling it missing.
LIBRARY_READERS = {
    "sha256-file": ("model.safetensors", _sha256_file),
    "ple-table-mapping": ("table.bin", _table_mapping),
    "ple-drive-check": ("table.bin", _drive_check),
    "selftest-report": ("report.json", _selftest_report),
    "selftest-tokenizer-config": ("config.json", _selftest_tokenizer),
    "capacity-config": ("config.json", _capacity_config),
}


@pytest.mark.parametrize("reader", sorted(LIBRARY_READERS))
def test_a_fifo_is_refused_by_every_library_reader(reader, tmp_path):
    name, read = LIBRARY_READERS[reader]
    fifo = fifo_at(tmp_path / name)
    with hang_guard(), pytest.raises(FlashnextError, match="is a FIFO, not a regular file"):
        read(fifo)
    assert tree_state(tmp_path) == {name: ("fifo",)}


def _rewrite_when(condition: Callable[..., bool]) -> Callable:
    """A wrapper of a hook: the first call for which ``condition(*args)`` holds rewrites the source."""
    def wrap(real, rewrite: Callable[[], None], rewritten: list):
        def hook(*args, **kwargs):
            if not rewritten and condition(*args, **kwargs):
                rewrite()
                rewritten.append(True)
            return real(*args, **kwargs)
        return hook
    return wrap


# Runs once every source has been read for the last time and just before the output is renamed into
# place: an overlay build's read-back of what it made; for ple build, the moment the table has its
# copy statistics, made once after the last read of the snapshot.
BEFORE_OVERLAY_COMMIT = ("flashnext.quant.overlays.builder", "check_readable", _rewrite_when(lambda *a: True))
BEFORE_PLE_COMMIT = ("flashnext.quant.ple.table", "CopyStats", _rewrite_when(lambda *a: True))

COMMIT_SOURCES = [  # the command, the source someone rewrites, the hook that rewrites it
    ("mtp-shard", mtp, MTP_SHARD, BEFORE_OVERLAY_COMMIT),
    ("mtp-config", mtp, "config.json", BEFORE_OVERLAY_COMMIT),
    ("mtp-index", mtp, INDEX, BEFORE_OVERLAY_COMMIT),
    ("repack-shard", repack_quietly, REWRITTEN_BY_REPACK, BEFORE_OVERLAY_COMMIT),
    ("repack-config", repack_quietly, "config.json", BEFORE_OVERLAY_COMMIT),
    ("ple-build-shard", ple_build, PLE_SHARD, BEFORE_PLE_COMMIT),
    ("ple-build-index", ple_build, INDEX, BEFORE_PLE_COMMIT),
]


@pytest.mark.parametrize("rewrite", sorted(REWRITES))
@pytest.mark.parametrize("command, source, hook", [c[1:] for c in COMMIT_SOURCES], ids=[c[0] for c in COMMIT_SOURCES])
def test_a_source_rewritten_after_its_last_read_makes_no_output(command, source, hook, rewrite, work, monkeypatch):
    import importlib

    module, function, wrap = hook
    mod = importlib.import_module(module)
    rewritten: list = []
    monkeypatch.setattr(mod, function, wrap(getattr(mod, function), lambda: REWRITES[rewrite](work.snap / source),
                                            rewritten))
    argv = command(work)
    before = tree_state(work.root)
    result, line = invoke_expecting_one_line(argv)
    assert rewritten, "the hook never ran"
    assert result.exit_code == 1, line
    assert line.startswith("Error: ") and f"{source}: " in line, line
    assert "while flashnext was reading it; nothing was written" in line, line
    changed = f"snap/{source}"
    after = tree_state(work.root)
    assert {k: v for k, v in after.items() if k != changed} == {k: v for k, v in before.items() if k != changed}


def test_the_int8_modules_hook_matches_through_the_bounded_matcher():
    from types import SimpleNamespace

    from vllm.model_executor.models import ModelRegistry

    from flashnext.serving.hooks.int8_modules import int8_group_size

    # The rename mapper vLLM applies to this model's quantization config (what the hook looks up
    # through vllm_names.rename_mapper inside a running engine).
    mapper = ModelRegistry._try_load_model_cls("Qwen4ExpForConditionalGeneration").hf_to_vllm_mapper.get_rename_mapper()
    int8 = {"weights": SimpleNamespace(num_bits=8, type="int", symmetric=True, strategy="group", group_size=128)}
    hostile = SimpleNamespace(target_scheme_map={"re:.*embed_tokens$": int8}, ignore=[CATASTROPHIC])
    started = time.monotonic()
    with hang_guard(5), pytest.raises(FlashnextError, match="exponential time"):
        int8_group_size(hostile, "language_model.model.mtp.layers.0.mlp.experts.0.gate_proj", mapper=mapper)
    assert time.monotonic() - started < 1.0
    # compressed-tensors' semantics, on vLLM's name or its trailing parts: re.match, or equality
    plain = SimpleNamespace(target_scheme_map={"re:.*embed_tokens$": int8, "lm_head": int8}, ignore=[r"re:^mtp\..*"])
    assert int8_group_size(plain, "language_model.model.embed_tokens", mapper=mapper) == 128
    assert int8_group_size(plain, "language_model.lm_head", mapper=mapper) == 128
    # re.match anchors ^mtp at the start of vLLM's whole name, so vLLM's should_ignore_layer does not
    # ignore this one (and serves it through the embed_tokens target); a name that starts with mtp is.
    assert int8_group_size(plain, "language_model.model.mtp.embed_tokens", mapper=mapper) == 128
    assert int8_group_size(plain, "mtp.embed_tokens", mapper=mapper) is None  # ignored
    assert int8_group_size(plain, "language_model.model.layers.0.mlp.gate_proj", mapper=mapper) is None


@pytest.mark.parametrize("argv", [["--format", "nvfp4", "--layer", "0"], ["--format", "fp8", "--layer", "1"],
                                  ["--format", "bf16", "--device", "cuda"]], ids=["nvfp4-layer", "fp8-layer", "bf16-device"])
def test_a_ple_build_option_its_format_ignores_is_refused(argv, work: Work):
    """Issue 42 item 6: `ple build --format nvfp4|fp8` quantizes every PLE layer's table and silently
    ignored --layer, even --layer 0 given explicitly; refused before anything is read or written."""
    result, line = invoke_expecting_one_line(["ple", "build", "--src", str(work.snap), "--out", str(work.root / "o"), *argv])
    assert result.exit_code == 2 and " is for " in line and not (work.root / "o").exists()


# --- every refusal is one line on stderr; a usage conflict is the documented usage error, 2 ---------

def _bench_ready() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("httpx", "matplotlib", "jsonschema"))


def bench(w: Work, *extra: str) -> list[str]:
    return ["bench", "http://127.0.0.1:9", "--out", str(w.root / "bench"), *extra]


def no_bench(reason: str = "flashnext[bench] is not installed"):
    return pytest.mark.skipif(not _bench_ready(), reason=reason)


def ple_build_with(*extra: str) -> Callable[[Work], list[str]]:
    return lambda w: [*ple_build(w), *extra]


def serve(w: Work, *extra: str) -> list[str]:
    return ["serve", "--profile", "3x3090", "--model", str(w.snap), *extra]


# (id, the command line, its exit status, words of its one line). Usage conflicts first: options that
# contradict each other, or one that another needs, are usage errors, exit 2, as README's exit table
# and flashnext.errors.UsageError say ("options that cannot go together"); then refusals of input.
ONE_LINE_REFUSALS = [
    pytest.param(lambda w: repack(w, "--reverse", "--to", "int8"), 2, "--reverse and --to are exclusive",
                 id="repack-int6-reverse-and-to"),
    pytest.param(lambda w: bench(w, "--phases", "latency,warp"), 2, "--phases", id="bench-unknown-phase",
                 marks=no_bench()),
    pytest.param(lambda w: bench(w, "--against", "http://127.0.0.1:8", "--baseline", str(w.root / "r.json")), 2,
                 "give --against or --baseline, not both", id="bench-against-and-baseline", marks=no_bench()),
    pytest.param(lambda w: serve(w, "--check", "--no-check"), 2, "contradict each other", id="serve-check-no-check"),
    pytest.param(ple_build_with("--format", "fp8", "--layer", "1"), 2, "--layer is for the bf16 table file",
                 id="ple-build-layer-with-fp8"),
    pytest.param(ple_build_with("--device", "cuda"), 2, "--device is for --format nvfp4|fp8", id="ple-build-device-bf16"),
    pytest.param(lambda w: mtp(w, "--quantizer", "gptq"), 2, "--calib is needed by quantizer gptq",
                 id="mtp-gptq-without-calib"),
    pytest.param(lambda w: mtp(w, "--quantizer", "gptq", "--no-scale-search"), 2,
                 "--quantizer gptq and --no-scale-search choose different quantizers",
                 id="mtp-quantizer-gptq-without-scale-search"),
    pytest.param(lambda w: ["ple", "ids", "--config", str(w.snap / "config.json"), "--tokens", "1,x"], 2,
                 "comma-separated integers", id="ple-ids-tokens-not-integers"),
    # Refusals of input, exit 1.
    pytest.param(lambda w: ["overlay", "verify", str(w.ov)], 1, "is not a view", id="overlay-verify-no-base"),
    pytest.param(lambda w: ["ple", "verify", str(w.root / "none.bin")], 1, "is missing", id="ple-verify-no-sidecar"),
    pytest.param(lambda w: ["ple", "residency", str(w.root / "none.bin")], 1, "no such file", id="ple-residency-none"),
    pytest.param(lambda w: ["ple", "layout", "--src", str(w.root / "none")], 1, "not a directory",
                 id="ple-layout-no-snapshot"),
    pytest.param(lambda w: ["make-mtp-int4", "--src", str(w.snap), "--out", str(w.snap)], 1,
                 "is the source snapshot itself", id="mtp-out-is-src"),
    pytest.param(lambda w: apply(w, out=w.snap), 1, "is the base snapshot itself", id="apply-out-is-base"),
    pytest.param(lambda w: ["doctor", "--profile", "no-such-profile"], 1, "no serving profile", id="doctor-no-profile"),
    pytest.param(lambda w: serve(w, "--check"), 1, "pass --ple-table FILE", id="serve-without-its-ple-table"),
    pytest.param(lambda w: ["patches", "check", "--vllm", str(w.root / "none")], 1, "No such file",
                 id="patches-check-no-vllm"),
]


@pytest.mark.parametrize("argv, code, words", ONE_LINE_REFUSALS)
def test_every_refusal_is_one_line_on_stderr(argv, code, words, work: Work):
    """Issue 42 item 6: a usage error a command raised itself through click (repack-int6's --reverse
    with --to, bench's --phases) printed click's usage block, three lines, where every other refusal
    prints one. (begin()'s first line goes to a terminal only, never here.)"""
    args = argv(work)
    before = tree_state(work.root)
    result = CliRunner().invoke(cli, args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and result.stdout == "", result.output
    assert result.exit_code == code and lines[0].startswith("Error: ") and words in lines[0], lines[0]
    assert tree_state(work.root) == before, "the command wrote or removed something"


def test_options_that_cannot_go_together_are_the_documented_usage_error():
    """The exit table documents usage errors, options that cannot go together included, as 2: the
    code (flashnext.errors) and README say the same."""
    from flashnext.errors import EXIT_CODES, UsageError

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = " ".join(readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0].split())
    two = table.split("; 2 ", 1)[1].split(";", 1)[0]
    assert "usage error" in two and "options that cannot go together" in two, two
    assert EXIT_CODES[UsageError] == 2


def test_a_deep_document_is_refused_before_the_parser_recurses(monkeypatch):
    """json's parser recurses once a level: a document 10^5 deep took it to the interpreter's limit,
    where a finalizer that happened to run failed again and printed a page of traceback beside the
    one line (CI, stop 49). The depth is counted first, without recursion, so the parser never sees
    it; brackets inside strings are no nesting."""
    from flashnext.quant.records import jsonfile

    depth = jsonfile.MAX_DEPTH
    assert jsonfile.parse_json("[" * depth + "]" * depth, "edge.json") == eval("[" * depth + "]" * depth)
    text = json.dumps({"s": "[" * 500, "t": '\\"{' * 500, "u": ["]"]})
    assert jsonfile.parse_json(text, "strings.json") == json.loads(text)
    assert jsonfile.parse_json(text.encode("utf-16"), "utf16.json") == json.loads(text)

    parsed = []
    monkeypatch.setattr(jsonfile.json, "loads", lambda text, **kwargs: parsed.append(text))
    for deep in ("[" * (depth + 1) + "]" * (depth + 1), '{"a":' * 100_000 + "1" + "}" * 100_000,
                 "[" * 100_000):
        with pytest.raises(FlashnextError, match=f"deep.json: JSON nested more than {depth} levels deep"):
            jsonfile.parse_json(deep, "deep.json")
    assert not parsed
