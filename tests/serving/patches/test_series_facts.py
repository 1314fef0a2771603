"""Facts about the patch series that live in one place and are named elsewhere: the tests each
entry of the registry cites, and the programs the serving image needs to apply the series."""

import ast
import re
import shlex

import pytest

from support import ROOT

from flashnext.serving.patches.series import SERIES

# a repository path in backticks, optionally ::test_name (pytest's node id)
REFERENCE = re.compile(r"`((?:tests|benchmarks)/[^`\s:]+)(?:::([A-Za-z_][A-Za-z0-9_]*))?`")


def cited(tests: str) -> list[tuple[str, str | None]]:
    return [(path, name or None) for path, name in REFERENCE.findall(tests)]


def defines(path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
               for node in ast.walk(tree))


def test_the_reference_pattern_reads_both_forms():
    tests = "`tests/a/test_b.py::test_c`: words; `tests/d.py` and `benchmarks/e.py` in `docs/x.md`"
    assert cited(tests) == [("tests/a/test_b.py", "test_c"), ("tests/d.py", None), ("benchmarks/e.py", None)]


@pytest.mark.parametrize("patch", SERIES, ids=[p.id for p in SERIES])
def test_every_test_a_patch_cites_exists(patch):
    refs = cited(patch.tests)
    assert refs, f"{patch.id}: its `tests` field names no test file"
    missing = []
    for path, name in refs:
        file = ROOT / path
        if not file.is_file():
            missing.append(path)
        elif name and not defines(file, name):
            missing.append(f"{path}::{name}")
    assert missing == [], f"{patch.id} cites what does not exist"


# --- the serving image ---------------------------------------------------------------------------

DOCKERFILE = ROOT / "serving" / "Dockerfile"


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def apt_installed(text: str) -> set[str]:
    packages = set()
    for word, args in dockerfile_instructions(text):
        if word != "RUN":
            continue
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, "&&"]:
            if token not in ("&&", ";", "||", "|"):
                command.append(token)
                continue
            if command[:1] in (["apt-get"], ["apt"]) and "install" in command:
                packages |= {t for t in command[command.index("install") + 1:] if not t.startswith("-")}
            command = []
    return packages


def programs_the_series_runs() -> set[str]:
    """The external programs serving/patch_series.py starts: the first element of every literal
    argument list it builds (``sys.executable`` is the image's own Python)."""
    tree = ast.parse((ROOT / "serving" / "patch_series.py").read_text())
    programs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.List) and node.elts and isinstance(node.elts[0], ast.Constant) \
                and isinstance(node.elts[0].value, str) and len(node.elts) > 2 \
                and any(isinstance(e, ast.Constant) and str(e.value).startswith("-") for e in node.elts):
            programs.add(node.elts[0].value)
    return programs


def test_the_program_finder_sees_patch():
    assert "patch" in programs_the_series_runs()


def test_the_apt_parser():
    text = "FROM x\n# RUN apt-get install -y nope\nRUN apt-get update && \\\n    apt-get install -y --no-install-recommends patch curl \\\n && rm -rf /var/lib/apt/lists/*\n"
    assert apt_installed(text) == {"patch", "curl"}


def test_the_image_installs_every_program_patches_apply_and_check_run():
    """The vLLM base image is Ubuntu without `patch`; `flashnext patches check` in the Dockerfile
    fails on it unless the image installs the program (the Debian/Ubuntu package of the same name)."""
    text = DOCKERFILE.read_text()
    steps = dockerfile_instructions(text)
    installed = apt_installed(text)
    assert programs_the_series_runs() - installed == set()
    first_use = next(i for i, (word, args) in enumerate(steps) if word == "RUN" and "patches check" in args)
    install = next(i for i, (word, args) in enumerate(steps) if word == "RUN" and "apt-get install" in args)
    assert install < first_use, "the programs are installed before `patches check` runs"
    # the image's build step is the real command line: `patches check` then `patches apply`
    assert "flashnext patches apply --target" in steps[first_use][1]
