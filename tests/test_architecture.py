"""The layers docs/architecture.md states, held against every import in the package.

docs/architecture.md's "The layers" block is the one statement of the order (top first): a module
may import its own layer and the layers below it, never one above. This file reads that block, maps
every module of the package to a layer (the most specific entry naming it: a file over its folder,
a deeper folder over a shallower one), and checks each ``import`` of a ``flashnext`` module:

* at the top of a file, inside a function, or under ``TYPE_CHECKING``: all of them are arrows a
  reader (or a tool that follows imports) sees, so all of them must point down or sideways;
* the imports that run when a module is loaded (outside functions and ``TYPE_CHECKING``) have no
  cycle anywhere in the package;
* counting every import, ``serving/bench/`` has no cycle at all, and the rest of the package none
  beyond :data:`ALLOWED_CYCLES`, each with its reason.

The modules are found the way setuptools finds them: pyproject.toml's ``package-dir`` maps the
``flashnext.`` names to the folders at the repository root (``flashnext.quant`` is ``quant/``).
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from support import ROOT

ARCHITECTURE = ROOT / "docs" / "architecture.md"

# Arrows that run up a layer and stay for now: (importing module, imported module) -> why.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("flashnext.serving.hooks.ple_file", "flashnext.serving.models.qwen4_exp"):
        "ple-mmap's embedding hook refuses to serve the table file unless vLLM's registry in this process "
        "resolves the model to flashnext's class, whose model state stages the rows; it asks that module "
        "(qwen4_exp.registered), inside a function run by the patched vLLM",
}

# Cycles of imports (counting those inside functions) that stay for now: the modules -> why.
ALLOWED_CYCLES: dict[frozenset[str], str] = {
    frozenset({"flashnext.serving.hooks.ple_file", "flashnext.serving.models.qwen4_exp"}):
        "the model state calls ple_file.attach; ple_file's embedding hook asks qwen4_exp whether that model "
        "state is the one vLLM builds (ALLOWED_UPWARD's entry)",
}


# --- the package map --------------------------------------------------------------------------------

@cache
def package_dirs() -> dict[str, str]:
    """pyproject.toml's ``[tool.setuptools.package-dir]``: package name -> folder under the root."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def folder_module(rel: Path) -> str:
    """The module a folder or ``.py`` file under the root is, through the package map."""
    parts = rel.with_suffix("").parts if rel.suffix == ".py" else rel.parts
    # the longest package whose folder holds it
    best = max((p for p, d in package_dirs().items() if parts[:len(Path(d).parts)] == Path(d).parts),
               key=lambda p: len(Path(package_dirs()[p]).parts))
    names = [best, *parts[len(Path(package_dirs()[best]).parts):]]
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names)


@cache
def modules() -> dict[str, Path]:
    """Every module of the package: its dotted name -> its file."""
    found = {}
    for folder in set(package_dirs().values()):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "__pycache__" not in rel.parts:
                found.setdefault(folder_module(rel), path)
    return found


def test_the_map_is_pyprojects():
    assert modules()["flashnext.quant.formats.packing"] == ROOT / "quant" / "formats" / "packing.py"
    assert modules()["flashnext.serving"] == ROOT / "serving" / "__init__.py"
    assert modules()["flashnext.errors"] == ROOT / "flashnext" / "errors.py"


# --- the imports ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arrow:
    source: str
    target: str
    line: int
    at_load: bool  # runs when the source is loaded: not inside a function, not under TYPE_CHECKING

    def __str__(self) -> str:
        return f"{modules()[self.source].relative_to(ROOT)}:{self.line} -> {self.target}"


def resolve(name: str) -> str | None:
    """The module ``name`` is or lies in (``flashnext.envs.VAR`` is ``flashnext.envs``)."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@cache
def arrows(module: str) -> tuple[Arrow, ...]:
    """Every import of a flashnext module in ``module``'s file, at any depth, and every module it
    names to ``importlib.import_module`` as a literal."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Arrow] = []

    def add(name: str, node: ast.AST, at_load: bool) -> None:
        target = resolve(name) if name == "flashnext" or name.startswith("flashnext.") else None
        if target and target != module:
            found.append(Arrow(module, target, node.lineno, at_load))

    def visit(node: ast.AST, at_load: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, at_load)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:  # ``from a import b``: the module a.b where there is one, else a
                add(f"{source}.{alias.name}", node, at_load)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value, node, False)
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, at_load)
            return
        inside = at_load and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text()), True)
    return tuple(dict.fromkeys(found))  # ``from a import b, c``: one arrow per line and module


def all_arrows() -> list[Arrow]:
    return [a for m in sorted(modules()) for a in arrows(m)]


def test_imports_are_absolute():
    """``from .x import y`` is resolved against the folder a tool sees; ``flashnext.`` names read
    the same everywhere (docs/architecture.md, "Reading the package map")."""
    relative = [f"{p.relative_to(ROOT)}:{n.lineno}" for m, p in modules().items()
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative, relative


# --- the layers -------------------------------------------------------------------------------------

@cache
def layers() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """docs/architecture.md's layers, bottom first: (name, the paths the block gives it)."""
    section = ARCHITECTURE.read_text().split("\n## The layers\n", 1)[1]
    block = re.search(r"```\n(.*?)\n```", section, re.S)[1]
    rows: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():  # a continuation of the layer above
            rows[-1][1].extend(line.split())
        else:
            name, *paths = line.split()
            rows.append((name, paths))
    return tuple((name, tuple(paths)) for name, paths in reversed(rows))


def entries() -> list[tuple[str, bool, int]]:
    """(module, whether a folder (it and all under it), layer index) for each path of the block."""
    out = []
    for index, (_, paths) in enumerate(layers()):
        for path in paths:
            out.append((folder_module(Path(path.rstrip("/"))), path.endswith("/"), index))
    return out


@cache
def layer_of(module: str) -> int | None:
    matches = [(len(name.split(".")), not folder, index) for name, folder, index in entries()
               if module == name or (folder and module.startswith(name + "."))]
    return max(matches)[2] if matches else None


def layer_name(module: str) -> str:
    return layers()[layer_of(module)][0]


def test_the_block_names_real_modules_once():
    names = [n for n, _ in layers()]
    assert len(names) == len(set(names)), names
    for name, folder, _ in entries():
        assert name in modules(), f"docs/architecture.md's layers name {name}, which is no module"
        if folder:  # a file names its module alone: ``serving/__init__.py`` is the package's own code
            assert modules()[name].name == "__init__.py", f"{name} is named as a folder and is no package"
    named = [(n, f) for n, f, _ in entries()]
    assert len(named) == len(set(named)), "a path is in two layers"


def test_every_module_has_a_layer():
    missing = sorted(m for m in modules() if layer_of(m) is None)
    assert not missing, f"no layer in docs/architecture.md holds {missing}"


def test_no_import_runs_up_a_layer():
    wrong = [f"{a} ({layer_name(a.source)} imports {layer_name(a.target)})" for a in all_arrows()
             if layer_of(a.target) > layer_of(a.source) and (a.source, a.target) not in ALLOWED_UPWARD]
    assert not wrong, "imports that run up a layer:\n" + "\n".join(wrong)


@pytest.mark.parametrize("arrow", sorted(ALLOWED_UPWARD), ids=" -> ".join)
def test_each_allowed_upward_arrow_is_still_there(arrow):
    """An allowance that nothing needs any more is deleted, so the list says what is left."""
    source, target = arrow
    assert any(a.target == target for a in arrows(source)), f"{source} no longer imports {target}: drop it"
    assert layer_of(target) > layer_of(source), f"{source} -> {target} no longer runs up: drop it"


# --- cycles -----------------------------------------------------------------------------------------

def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def graph_of(at_load_only: bool, within: str = "flashnext") -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules() if m == within or m.startswith(within + ".")}
    for module in graph:
        graph[module] |= {a.target for a in arrows(module)
                          if a.target in graph and (a.at_load or not at_load_only)}
    return graph


def describe(component: frozenset[str]) -> str:
    return ", ".join(sorted(component)) + ":\n  " + "\n  ".join(
        str(a) for m in sorted(component) for a in arrows(m) if a.target in component)


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_cycle_among_the_imports_that_run_at_load():
    found = cycles(graph_of(at_load_only=True))
    assert not found, "\n".join(map(describe, found))


def test_bench_has_no_import_cycle():
    """Not even through a function or ``TYPE_CHECKING``: the report's types and the phases'
    defaults sit below the phases that use them, the phases below the runner that runs them."""
    found = cycles(graph_of(at_load_only=False, within="flashnext.serving.bench"))
    assert not found, "\n".join(map(describe, found))


def test_no_import_cycle_beyond_the_allowed():
    found = [c for c in cycles(graph_of(at_load_only=False)) if c not in ALLOWED_CYCLES]
    assert not found, "\n".join(map(describe, found))


@pytest.mark.parametrize("cycle", sorted(ALLOWED_CYCLES, key=sorted), ids=lambda c: " ".join(sorted(c)))
def test_each_allowed_cycle_is_still_there(cycle):
    assert cycle in cycles(graph_of(at_load_only=False)), f"{sorted(cycle)} is no cycle any more: drop it"
