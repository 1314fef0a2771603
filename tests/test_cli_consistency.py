"""Every command behaves alike: ``-h``, help text on every option, usage errors exit 2, a
verification's mismatch exits 3, sizes in a unit that fits, answers before any torch/vLLM noise, and
refusals (and commands that touch no tensor) without importing torch."""

import json
import re
import subprocess
import sys
import tomllib

import click
import pytest
from click.testing import CliRunner

from flashnext.errors import EXIT_CODES, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED, NoGoCode
from flashnext.sizes import format_size
from flashnext.tools.cli import main as flashnext
from support import ROOT
from support.no_torch import probe


def console_scripts() -> dict[str, click.Command]:
    """pyproject.toml's console scripts: each is a root of its own (`make-mtp-int4`, `serve`)."""
    import importlib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    roots = {}
    for name, target in scripts.items():
        module, attr = target.split(":")
        roots[name] = getattr(importlib.import_module(module), attr)
    return roots


def walk(command: click.Command, path: tuple[str, ...] = ()):
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from walk(sub, (*path, name))


ROOTS = console_scripts()
# (script, the words after it) for every command and group, through every console script.
EVERY_COMMAND = [(script, path) for script, root in ROOTS.items() for path, _ in walk(root)]
FLASHNEXT_COMMANDS = [list(path) for path, _ in walk(flashnext)]


def _id(case) -> str:
    script, path = case
    return " ".join((script, *path))


def test_the_scripts_are_the_expected_roots():
    assert set(ROOTS) == {"flashnext", "make-mtp-int4", "serve"}
    assert ROOTS["flashnext"] is flashnext


DASH_H_PROBE = """
import importlib, sys
import click
from click.testing import CliRunner

script, target = sys.argv[1:]
module, attr = target.split(":")
root = getattr(importlib.import_module(module), attr)

def walk(command, path=()):
    yield path
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from walk(sub, (*path, name))

for path in walk(root):
    done = CliRunner().invoke(root, [*path, "-h"], prog_name=script)
    if done.exit_code != 0 or not done.output.startswith("Usage: " + " ".join((script, *path))):
        print(" ".join((script, *path)), "exit", done.exit_code, done.output.strip().splitlines()[-1:])
"""


@pytest.mark.parametrize("script", sorted(ROOTS))
def test_dash_h_is_help_on_every_command_and_group(script):
    """Each console script in a fresh interpreter, as it runs (`make-mtp-int4` and `serve` are roots of
    their own; click keeps a command's help option once made, so one process per root)."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][script]
    done = subprocess.run([sys.executable, "-c", DASH_H_PROBE, script, target], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", done.stdout


def test_an_unknown_option_is_a_usage_error_everywhere():
    """One line, as every refusal: click's usage block and hint become the line's pointer to --help."""
    wrong = []
    for script, path in EVERY_COMMAND:
        done = CliRunner().invoke(ROOTS[script], [*path, "--no-such-option"], prog_name=script)
        lines = done.output.strip().splitlines()
        help_hint = f"(see `{' '.join((script, *path))} --help`)"
        if done.exit_code != 2 or len(lines) != 1 or "No such option" not in lines[0] or help_hint not in lines[0]:
            wrong.append(f"{_id((script, path))}: exit {done.exit_code}: {done.output!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("argv", [["no-such-command"], ["plan", "--kv-cache-memory-bytes"], ["doctor"],
                                  ["ple", "ids", "--tokens"]], ids=" ".join)
def test_a_line_click_cannot_parse_is_one_line(argv):
    done = CliRunner().invoke(flashnext, argv, prog_name="flashnext")
    lines = done.output.strip().splitlines()
    assert done.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), done.output


def test_every_command_and_option_says_what_it_is():
    missing = []
    for path, command in walk(flashnext):
        where = " ".join(("flashnext", *path))
        if not (command.help or "").strip():
            missing.append(f"{where} (the command)")
        missing += [f"{where} {p.opts[0]}" for p in command.params
                    if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip()]
    assert not missing, "no help text: " + ", ".join(missing)


# --- usage errors flashnext finds itself exit 2, as click's own do: one line, nothing written ----------
USAGE_ERRORS = [
    (["make-mtp-int4", "--src", "{snap}", "--out", "{new}", "--quantizer", "gptq"],
     "--calib is needed by quantizer gptq"),
    (["make-mtp-int4", "--src", "{snap}", "--out", "{new}", "--calib", "{snap}/config.json", "--quantizer", "rtn"],
     "--calib weights the scale search"),
    (["make-mtp-int4", "--src", "{snap}", "--out", "{new}", "--quantizer", "mse", "--rounding", "gptq"],
     "--quantizer mse and --rounding gptq choose different quantizers"),
    (["serve", "--profile", "3x3090"], "serve needs --model (see"),
    (["serve", "--profile", "3x3090", "--model", "{snap}", "--check", "--no-check"], "contradict"),
    (["ple", "ids", "--config", "{snap}/config.json", "--tokens", "1,x"], "comma-separated integers"),
    (["ple", "ids", "--config", "{snap}/config.json", "--tokens", ","], "--tokens is empty"),
]


@pytest.mark.parametrize("argv, words", USAGE_ERRORS, ids=lambda v: " ".join(v[:2]) if isinstance(v, list) else v)
def test_usage_errors_exit_2(demo_snapshot, tmp_path, argv, words):
    args = [a.format(snap=demo_snapshot, new=tmp_path / "new") for a in argv]
    done = CliRunner().invoke(flashnext, args)
    lines = done.output.strip().splitlines()
    assert done.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), done.output
    assert words in lines[0]
    assert not (tmp_path / "new").exists()


# --- a verification's mismatch is exit 3 in every command; input it cannot read stays 1 --------------
def _corrupt_block(table):
    with open(table, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(table):
    with open(table, "r+b") as f:
        f.truncate(table.stat().st_size - 1)


def _drop_sidecar(table):
    table.with_name(table.name + ".json").unlink()


def _bad_sidecar(table):
    table.with_name(table.name + ".json").write_text("{not json")


PLE_VERIFY = [
    ("a block differs", _corrupt_block, 3, "differs from its source"),
    ("the size differs", _truncate, 3, "bytes; its layout needs exactly"),
    ("no sidecar", _drop_sidecar, 1, ""),
    ("a malformed sidecar", _bad_sidecar, 1, ""),
]


@pytest.fixture(scope="module")
def ple_table(demo_snapshot, tmp_path_factory):
    from flashnext.quant.ple.table import build_table

    out = tmp_path_factory.mktemp("ple") / "table.bin"
    build_table(demo_snapshot, out, 0, progress=False)
    return out


@pytest.mark.parametrize("what, damage, code, words", PLE_VERIFY, ids=[c[0] for c in PLE_VERIFY])
def test_ple_verify_exit_codes(ple_table, tmp_path, what, damage, code, words):
    table = tmp_path / "table.bin"
    table.write_bytes(ple_table.read_bytes())
    table.with_name("table.bin.json").write_bytes(ple_table.with_name("table.bin.json").read_bytes())
    damage(table)
    done = CliRunner().invoke(flashnext, ["ple", "verify", "--full", "--no-progress", str(table)])
    lines = done.output.strip().splitlines()
    # a mismatch is the verdict, worded as `overlay verify` words its own; unreadable input an error
    start = f"mismatch: {table}: " if code == 3 else "Error: "
    assert done.exit_code == code and len(lines) == 1 and lines[0].startswith(start), done.output
    assert words in lines[0]


def test_ple_verify_and_overlay_verify_word_a_mismatch_alike(ple_table, demo_snapshot, demo_overlay, tmp_path):
    """Issue 41: the same exit-3 result was "Error: TABLE: ..." from one and "mismatch: FILE: ..."
    from the other; both now print "mismatch: PATH: what differs", on stderr, and no "Error:" line,
    and --json gives both the same shape."""
    import shutil

    table = tmp_path / "table.bin"
    table.write_bytes(ple_table.read_bytes())
    table.with_name("table.bin.json").write_bytes(ple_table.with_name("table.bin.json").read_bytes())
    _corrupt_block(table)
    overlay = tmp_path / "overlay"
    shutil.copytree(demo_overlay, overlay)
    with open(overlay / "config.json", "a") as f:
        f.write(" ")
    runs = {"ple": (["ple", "verify", str(table)], table),
            "overlay": (["overlay", "verify", "--base", str(demo_snapshot), str(overlay)], "overlay/config.json")}
    for name, (argv, path) in runs.items():
        done = CliRunner().invoke(flashnext, argv)
        assert done.exit_code == 3 and done.stdout == "", (name, done.output)
        assert done.stderr.splitlines()[-1].startswith(f"mismatch: {path}: ") and "Error" not in done.stderr, name
        as_json = json.loads(CliRunner().invoke(flashnext, [*argv, "--json"]).stdout)
        assert as_json["ok"] is False and [set(m) for m in as_json["mismatches"]] == [{"path", "problem"}], name


def test_ple_layout_names_the_ple_layer_it_was_asked_for(demo_snapshot):
    """`--layer 0` printed "layer: 1" (the decoder layer the first PLE layer sits in)."""
    done = CliRunner().invoke(flashnext, ["ple", "layout", "--src", str(demo_snapshot), "--layer", "0"])
    assert done.exit_code == 0, done.output
    assert done.stdout.splitlines()[:2] == ["ple_layer: 0", "decoder_layer: 1"]


def test_the_readme_lists_the_exit_code_table():
    text = " ".join((ROOT / "README.md").read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0].split())
    listed = {int(n) for n in re.findall(r"(?:^|; |: )(\d+)(?:–\d+)? ", text)}
    assert listed == {0, *EXIT_CODES.values(), 10, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED}, text
    three = text.split("; 3 ", 1)[1].split(";", 1)[0]
    assert "`overlay verify`" in three and "`ple verify`" in three
    nogo = [c for c in NoGoCode if c]
    assert f"{nogo[0].value}–{nogo[-1].value} the preflight's NO-GO" in text
    assert [c.value for c in nogo] == list(range(nogo[0].value, nogo[-1].value + 1))


def test_doctor_names_every_no_go_code():
    """`flashnext doctor --help` restates the preflight's codes: the same numbers, each with its kind."""
    from flashnext.tools.doctor import main as doctor

    text = " ".join(doctor.help.split())
    for code in NoGoCode:
        word = {"GO": "go", "GPU": "GPU", "PLE": "PLE table"}.get(code.name, code.name.lower())
        assert f"{code.value} {word}" in text or f"{code.value} ({word})" in text, (code, text)


# --- sizes --------------------------------------------------------------------------------------------
SIZES = [(0, "0 B"), (320, "320 B"), (1023, "1,023 B"), (1024, "1.00 KiB"), (16 << 10, "16.00 KiB"),
         (3 << 19, "1.50 MiB"), (320_001_536 * 320, "95.37 GiB"), (4 << 40, "4,096.00 GiB")]


@pytest.mark.parametrize("n, text", SIZES)
def test_one_size_formatter_picks_the_unit(n, text):
    assert format_size(n) == text


def test_a_small_table_is_not_zero_gib(demo_snapshot, tmp_path):
    done = CliRunner().invoke(flashnext, ["ple", "build", "--src", str(demo_snapshot), "--out",
                                          str(tmp_path / "t.bin"), "--no-progress"])
    assert done.exit_code == 0, done.output
    assert "0.00 GiB" not in done.output and re.search(r"\(BF16, \d+\.\d\d KiB\)", done.output), done.output


# --- no torch before arguments and outputs are checked, nor where no tensor is touched ----------------

@pytest.fixture(scope="module")
def workdir(demo_snapshot, demo_overlay, ple_table, tmp_path_factory):
    """The demo snapshot, its MTP overlay, a view of them, the PLE table and an existing output."""
    from flashnext.quant.overlays.view import apply_overlays

    root = tmp_path_factory.mktemp("refusals")
    apply_overlays(demo_snapshot, [demo_overlay], root / "view")
    (root / "taken").mkdir()
    return {"snap": demo_snapshot, "overlay": demo_overlay, "view": root / "view", "table": ple_table,
            "taken": root / "taken", "new": root / "new", "root": root}


NO_TORCH = [
    ("demo-checkpoint over an existing --out", ["demo-checkpoint", "--out", "{taken}"], 1),
    ("make-mtp-int4 over an existing --out", ["make-mtp-int4", "--src", "{snap}", "--out", "{taken}"], 1),
    ("make-mtp-int4 --quantizer gptq without --calib",
     ["make-mtp-int4", "--src", "{snap}", "--out", "{new}", "--quantizer", "gptq"], 2),
    ("repack-int6 over an existing --out", ["repack-int6", "--src", "{snap}", "--out", "{taken}"], 1),
    ("ple ids", ["ple", "ids", "--config", "{snap}/config.json", "--tokens", "1,2,3"], 0),
    ("ple verify", ["ple", "verify", "{table}"], 0),
    ("overlay verify of a view", ["overlay", "verify", "{view}"], 0),
    ("overlay verify of an overlay", ["overlay", "verify", "--base", "{snap}", "{overlay}"], 0),
    ("plan of an unknown profile", ["plan", "--profile", "no-such-profile"], 1),
]


@pytest.mark.parametrize("what, argv, code", NO_TORCH, ids=[c[0] for c in NO_TORCH])
def test_refusals_and_tensorless_commands_do_not_import_torch(workdir, what, argv, code):
    result, stderr = probe([a.format(**workdir) for a in argv], workdir["root"])
    assert result["code"] == code, stderr
    assert not result["torch"], f"{what} imported torch"
    assert not workdir["new"].exists()


HELP_PROBE = ("import json, sys\nfrom flashnext.tools.cli import main\n"
              "for path in json.loads(sys.argv[1]):\n    try:\n        main([*path, '--help'])\n"
              "    except SystemExit:\n        pass\n    if 'torch' in sys.modules:\n"
              "        print(json.dumps(path), file=sys.stderr)\n        sys.exit(3)\n")


def test_help_of_every_command_does_not_import_torch():
    """One fresh interpreter runs every command's --help in turn and names the first that imported torch."""
    done = subprocess.run([sys.executable, "-c", HELP_PROBE, json.dumps(FLASHNEXT_COMMANDS)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 3, f"--help of {done.stderr.strip()} imported torch"
    assert done.returncode == 0, done.stderr


# --- plan and doctor: the answer is the first line, not vLLM's and torch's import-time notes ----------
FIRST_LINE = [
    (["plan", "--profile", "3x3090"], r"profile 3x3090: --kv-cache-memory-bytes "),
    (["doctor", "--profile", "3x3090"], r"\[(ok  |FAIL|warn)\] "),
]


@pytest.mark.slow
@pytest.mark.parametrize("argv, first", FIRST_LINE, ids=[c[0][0] for c in FIRST_LINE])
def test_the_answer_is_the_first_line(argv, first):
    pytest.importorskip("vllm")
    done = subprocess.run([sys.executable, "-m", "flashnext", *argv], capture_output=True, text=True, timeout=300)
    # stdout and stderr as a terminal shows them, stderr first: what vLLM and torch print goes there
    shown = (done.stderr + done.stdout).splitlines()
    assert shown and re.match(first, shown[0]), "\n".join(shown[:12])


# --- the library names fields, the commands name flags -----------------------------------------------

# vLLM's own arguments, as a profile's vllm_args or vLLM's command line hold them, which a library
# error names as such: plan's --kv-cache-memory-bytes overrides the profile's argument of that name;
# serve's --port fills vLLM's, which a profile may not set (profiles.FLASHNEXT_OPTIONS).
VLLMS_OWN = {("serving/capacity/shape.py", "--kv-cache-memory-bytes"),
             ("serving/runtime/host_pool.py", "--kv-cache-memory-bytes"),
             ("serving/profiles.py", "--port")}


def error_texts(path):
    """Each error a module raises (a call of a class named ``*Error``): its line, the string
    constants of its message joined, with what it quotes in backticks (another command's line to
    run) left out, and the inputs it names by field (``field=``, ``named(...)``)."""
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", None) or getattr(node.func, "attr", "")
        if not name.endswith("Error"):
            continue
        text = "".join(c.value for a in node.args for c in ast.walk(a)
                       if isinstance(c, ast.Constant) and isinstance(c.value, str))
        fields = {k.value.value for k in node.keywords if k.arg == "field" and isinstance(k.value, ast.Constant)}
        fields |= {c.args[0].value for a in node.args for c in ast.walk(a)
                   if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "named"
                   and c.args and isinstance(c.args[0], ast.Constant)}
        yield node.lineno, re.sub(r"`[^`]*`", "", text), fields


def test_the_library_names_no_flag_and_every_field_it_names_has_one():
    """An error of the library (quant/, serving/) carries the input it is about as ``field`` and
    names any other with ``named``; tools/_flags.py is the one map to the flag a command fills it
    from. No error there names a flag of a flashnext command itself, but vLLM's own arguments."""
    from flashnext.tools._flags import FLAGS

    flags = {opt for root in console_scripts().values() for _, command in walk(root) for param in command.params
             if isinstance(param, click.Option) for opt in (*param.opts, *param.secondary_opts)
             if opt.startswith("--")} - {"--help"}
    assert {"--out", "--force", "--ple-table", "--model", "--gpus"} <= flags
    fields, named = set(), []
    for path in sorted([*(ROOT / "quant").rglob("*.py"), *(ROOT / "serving").rglob("*.py")]):
        where = path.relative_to(ROOT).as_posix()
        for line, text, names in error_texts(path):
            fields |= names
            named += [f"{where}:{line} names {flag}" for flag in sorted(set(re.findall(r"--[a-z][a-z0-9-]*", text)))
                      if flag in flags and (where, flag) not in VLLMS_OWN]
    assert not named, named
    assert fields and fields <= set(FLAGS), fields - set(FLAGS)


def test_a_field_is_shown_as_its_flag(tmp_path):
    from flashnext.errors import FlashnextError
    from flashnext.tools._flags import as_typed

    error = FlashnextError(f"{tmp_path}: no such file", field="calib")
    assert str(error) == f"calib {tmp_path}: no such file"
    assert as_typed(error) == f"--calib {tmp_path}: no such file"
    assert as_typed(FlashnextError("plain")) == "plain"
    # an input named inside the message: its field in the library's line, its flag in the command's
    from flashnext.errors import named, said

    error = FlashnextError(f"{tmp_path} already exists: choose another {named('out')} or pass {named('force')}")
    assert str(error) == f"{tmp_path} already exists: choose another out or pass force"
    assert as_typed(error) == f"{tmp_path} already exists: choose another --out or pass --force"
    both = FlashnextError(f"{tmp_path}: no such file; or pass {named('quantizer')}", field="calib")
    assert as_typed(both) == f"--calib {tmp_path}: no such file; or pass --quantizer"
    # quoted in another text (a preflight finding), its inputs stay marked for the command to show
    from flashnext.errors import fields_shown
    from flashnext.tools._flags import flag_of

    assert fields_shown(f"no plan ({said(both)})", flag_of) == f"no plan (--calib {tmp_path}: no such file; or pass " \
                                                                "--quantizer)"
