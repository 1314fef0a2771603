"""The docs' promises that a reader relies on and no other test checks.

* docs/seed-000.md is what "seed 000 §N" means: the repository does not ship the seed, so every
  citation of it, anywhere in the tree, must land on a heading of the digest, and what the digest
  says flashnext does (patches, switches) must be what the patch registry and ``flashnext.envs`` say.
* docs/architecture.md is the one picture of the layout: every path it names exists, and the
  layering it states holds in the code's imports.
* docs/hostile.md's table of the hostile-input suite is what collecting ``tests/hostile`` gives:
  every module a surface with its number of attacks (tests/support/hostile_table.py makes it).

A bare section sign followed by a number cites seed 000 (that is how the code writes it, "(§7)");
a section of any other document is written after that document's file name ("upstream.md §5").
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from flashnext import envs
from support import ROOT

SECTION = "\N{SECTION SIGN}"
DIGEST = ROOT / "docs" / "seed-000.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# Not the project's text: tool caches, build output, the demo checkpoint and bench output.
SKIPPED_DIRS = {".git", "__pycache__", "build", "dist", "demo", ".whl", ".bench", ".pytest_cache", ".hypothesis"}
TEXT_SUFFIXES = {".py", ".md", ".json", ".patch", ".toml", ".txt", ".html", ".yaml", ".yml", ".cfg"}

NUMBER = r"(\d+(?:\.\d+)?)"
SIGN_CITATION = re.compile(SECTION + r"\s?" + NUMBER)
WORD_CITATION = re.compile(r"\bseed(?: 000)?(?:'s)?,?\s+sections?\s+" + NUMBER, re.I)
OTHER_DOCUMENT = re.compile(r"\.md`?\s*$")  # "…/upstream.md §5": that document's section, not the seed's
HEADING = re.compile(r"^##+ " + SECTION + NUMBER + r"\s", re.M)


def project_text_files() -> list[Path]:
    files = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name == "Dockerfile"):
            files.append(path)
    return files


def seed_citations() -> list[tuple[str, int, str]]:
    """``(file, line, section)`` for every citation of seed 000 in the tree."""
    found = []
    for path in project_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if path.suffix == ".json":
            text = text.replace("\\u00a7", SECTION)
        for match in SIGN_CITATION.finditer(text):
            if OTHER_DOCUMENT.search(text[max(0, match.start() - 80):match.start()]):
                continue
            found.append((str(path.relative_to(ROOT)), text.count("\n", 0, match.start()) + 1, match[1]))
        for match in WORD_CITATION.finditer(text):
            found.append((str(path.relative_to(ROOT)), text.count("\n", 0, match.start()) + 1, match[1]))
    return found


def digest_sections() -> dict[str, str]:
    """Each section of the digest by its number: its text up to the next heading."""
    text = DIGEST.read_text()
    heads = list(HEADING.finditer(text))
    ends = [h.start() for h in heads[1:]] + [len(text)]
    body = {}
    for head, end in zip(heads, ends):
        assert head[1] not in body, f"docs/seed-000.md has two headings for {SECTION}{head[1]}"
        body[head[1]] = text[head.start():end]
    return body


def test_the_digest_keeps_the_seeds_order():
    numbers = list(digest_sections())
    assert numbers == sorted(numbers, key=lambda n: tuple(int(p) for p in n.split("."))), numbers
    assert {"1", "3.3", "10"} <= set(numbers)


def test_every_seed_citation_has_a_heading_in_the_digest():
    sections = digest_sections()
    citations = seed_citations()
    assert len(citations) > 50, "the citation scanner found almost nothing: is it still reading the tree?"
    unresolved = [f"{file}:{line} cites {SECTION}{n}" for file, line, n in citations if n not in sections]
    assert not unresolved, "\n".join(unresolved)


def test_the_scanner_reads_every_form_the_tree_uses():
    """The forms seen in the tree, read as the scanner reads them (a stand-in text, not the tree)."""
    text = (f"(seed 000 {SECTION}3.3, {SECTION}7) the seed's (seed 000\n{SECTION}1) "
            f"(seed section 8) (seed 000, section 3.0) ../shared/reference/upstream.md {SECTION}5")
    numbers = [m[1] for m in SIGN_CITATION.finditer(text)
               if not OTHER_DOCUMENT.search(text[max(0, m.start() - 80):m.start()])]
    numbers += [m[1] for m in WORD_CITATION.finditer(text)]
    assert numbers == ["3.3", "7", "1", "8", "3.0"]


def registry():
    from flashnext.serving.patches.series import SERIES

    return SERIES


def flashnext_lines(section_text: str) -> str:
    """What a digest section says flashnext does: its "- flashnext:" item."""
    items = re.split(r"\n(?=- )", section_text)
    return "\n".join(i for i in items if i.startswith("- flashnext:"))


def patch_named(patch, text: str) -> bool:
    return any(re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) for name in (patch.id, patch.seed) if name)


# Seed effects that cite a section about other work, reported to the registry's owner.
KNOWN_MISCITATIONS: dict[str, str] = {}


@pytest.mark.parametrize("patch", [
    pytest.param(p, marks=pytest.mark.xfail(strict=False, reason=KNOWN_MISCITATIONS[p.id]))
    if p.id in KNOWN_MISCITATIONS else p for p in registry()], ids=lambda p: p.id)
def test_a_patch_is_named_where_its_seed_effect_cites_the_seed(patch):
    """A patch's seed effect (the registry's, shown in the READMEs) cites the digest's sections;
    the digest says that the same patch carries each section's work."""
    sections = digest_sections()
    wrong = [n for n in SIGN_CITATION.findall(patch.seed_effect) if n in sections and not patch_named(patch, sections[n])]
    assert not wrong, f"{patch.id}'s seed effect cites {wrong}, sections about other work"


def test_the_digest_names_real_patches_and_switches():
    """Where the digest says what flashnext does, its patch ids and seed codes are the registry's and its
    switches are flashnext.envs variables; and every patch the seed's work became is named there."""
    sections = digest_sections()
    claims = "\n".join(flashnext_lines(text) for text in sections.values())
    declared = {v.name for v in envs.DECLARED}
    named_vars = set(re.findall(r"`(VLLM_[A-Z0-9_]+)", claims))
    assert named_vars and named_vars <= declared, sorted(named_vars - declared)
    series = registry()
    for patch in series:
        if patch.seed or SIGN_CITATION.search(patch.seed_effect):
            assert patch_named(patch, claims), f"docs/seed-000.md never says what carries {patch.id}"
            assert patch.switch.name in claims, f"docs/seed-000.md names {patch.id} without its switch"
    known = {name for p in series for name in (p.id, p.seed) if name}
    # and the patches vLLM absorbed (series.ABSORBED: their work is vLLM's own since a release); where
    # the digest says what carries one (by a name no live patch also carries), it says it is absorbed
    from flashnext.serving.patches.series import ABSORBED

    items = re.split(r"\n(?=- )", claims)
    for patch in ABSORBED:
        names = [n for n in (patch.id, patch.seed) if n and n not in known]
        named = [item for item in items if any(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", item) for n in names)]
        assert all("ABSORBED" in item for item in named), f"docs/seed-000.md names {patch.id} as a live patch"
    known |= {name for p in ABSORBED for name in (p.id, p.seed) if name}
    codes = set(re.findall(r"\b(?:decode|ttft|mem|mtp)-\d\d\b", DIGEST.read_text()))
    # decode-01/02 and vllm.patch are the previous article's, which flashnext's series has no entry for
    assert codes - known <= {"decode-01", "decode-02"}, sorted(codes - known)


# --- docs/architecture.md ------------------------------------------------------------------------

ARCH_PATH = re.compile(r"(?<![\w./-])((?:quant|serving|tools|flashnext|manifests|docs|tests|benchmarks)/[\w./<>*-]*)")
# Named by the target layout of issue 27 and not in the tree yet (restructuring in progress).
PENDING: set[str] = set()


def named_paths(doc: Path) -> list[str]:
    return sorted({m[1].rstrip(".") for m in ARCH_PATH.finditer(doc.read_text())})


def architecture_paths() -> list[str]:
    return named_paths(ARCHITECTURE)


def path_exists(name: str) -> bool:
    if name.endswith("/"):
        return (ROOT / name).is_dir()
    pattern = re.sub(r"<[^>]+>", "*", name)
    return any(p.exists() for candidate in (pattern, pattern + ".py") for p in ROOT.glob(candidate))


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=False, reason="restructuring in progress")) if n in PENDING else n
    for n in architecture_paths()])
def test_architecture_names_paths_that_exist(name):
    assert path_exists(name), f"docs/architecture.md names {name}, which is not in the tree"


def test_the_digest_names_paths_that_exist():
    missing = [n for n in named_paths(DIGEST) if not path_exists(n)]
    assert not missing, f"docs/seed-000.md names {missing}, not in the tree"


def test_architecture_names_the_layout():
    names = set(architecture_paths())
    for package in ("quant/records/", "quant/checkpoint/", "quant/formats/", "quant/overlays/", "quant/quantizers/",
                    "quant/ple/", "quant/kernels/", "serving/hooks/", "serving/bench/", "tools/"):
        assert package in names, package
    assert {"quant/formats/ct_config.py", "quant/kernels/configs.py", "serving/patches/series.py"} <= names


# --- the layering -----------------------------------------------------------------------------------

PACKAGE_DIRS = {"flashnext": "flashnext", "quant": "flashnext.quant", "serving": "flashnext.serving",
                "tools": "flashnext.tools", "manifests": "flashnext.manifests"}


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGE_DIRS[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file, relative imports resolved, and the
    modules it names to ``importlib.import_module``."""
    package = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def sources(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


KNOWN_LIBRARY_VIOLATIONS: dict[str, str] = {}


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.xfail(strict=False, reason=KNOWN_LIBRARY_VIOLATIONS[str(p.relative_to(ROOT))]))
    if str(p.relative_to(ROOT)) in KNOWN_LIBRARY_VIOLATIONS else p
    for p in sources("quant")], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_never_imports_serving_or_tools(path):
    wrong = sorted(m for m in imports(path) if within(m, "flashnext.serving", "flashnext.tools", "click"))
    assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


def test_only_tools_import_click():
    """click is the command layer's; the library, serving and flashnext's core stay callable
    without it (tests may import it to drive the commands)."""
    wrong = [f"{p.relative_to(ROOT)}" for folder in ("flashnext", "quant", "serving", "manifests")
             for p in sources(folder) if any(within(m, "click") for m in imports(p))]
    assert not wrong, wrong


def test_the_foundation_imports_nothing_above_it():
    """quant/records is what every layer reads its inputs with, so it may use only flashnext's core
    (errors, envs, sizes) and itself."""
    core = ("flashnext.errors", "flashnext.envs", "flashnext.sizes")
    for path in sources("quant/records"):
        wrong = sorted(m for m in imports(path)
                       if within(m, "flashnext") and not within(m, "flashnext.quant.records", *core))
        assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


def test_the_core_imports_no_layer():
    """flashnext/ (errors, envs, sizes, progress) sits under every layer; only the entry point
    ``python -m flashnext`` reaches the commands."""
    for path in sources("flashnext"):
        if path.name == "__main__.py":
            continue
        wrong = sorted(m for m in imports(path) if within(m, "flashnext.quant", "flashnext.serving", "flashnext.tools"))
        assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


def test_the_hostile_table_is_the_suite_as_collected():
    """Issue 42: the table of attacks per surface is regenerated by collecting the suite (no test
    runs); a module added, a row added or removed, changes it: `python tests/support/hostile_table.py
    --write` rewrites it."""
    from support import hostile_table

    doc = hostile_table.generated_block(hostile_table.DOC.read_text())
    assert doc == hostile_table.table(hostile_table.collect()), \
        "docs/hostile.md's table is not the suite's: run python tests/support/hostile_table.py --write"
