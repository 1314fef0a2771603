"""The documents generated from the patch series: the patches README's tables and patch sections,
``docs/serving.md``'s patch sections and the top README's list of the series.

Each lives between two markers in a hand-written file, so that the prose around it stays the
authors' while every fact about a patch is rendered from ``series.py`` and each patch's prose (its diff's preamble, or a plugin entry's ``<id>.md``).
``flashnext patches readme --write`` rewrites them; a test fails when a file differs.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Sequence

from flashnext.errors import FlashnextError
from flashnext.serving.patches.series import ABSORBED, PATCH_DIR, Absorbed, Coverage, Patch

REPO_ROOT = PATCH_DIR.parents[1]  # only a source checkout has docs/ and README.md here
PATCHES_README = PATCH_DIR / "README.md"
SERVING_DOC = REPO_ROOT / "docs" / "serving.md"
TOP_README = REPO_ROOT / "README.md"


@dataclass(frozen=True)
class Prose:
    """A patch's prose (its diff's preamble, or a plugin entry's ``<id>.md``): a ``# title`` line, then a first paragraph that says what the patch
    fixes and how (the summary), then optionally more, whose headings start at ``##``."""

    title: str
    summary: str
    more: str


def prose(patch: Patch) -> Prose:
    text = patch.prose_path.read_text(encoding="utf-8")
    if patch.file is not None:  # a diff's preamble: the text before its first file header
        text = text[:text.find("\n--- a/") + 1] if "\n--- a/" in text else ""
    first, _, body = text.partition("\n")
    if not first.startswith("# ") or not body.strip():
        raise FlashnextError(f"{patch.prose_path}: must start with a `# title` line and a paragraph")
    summary, _, more = body.strip().partition("\n\n")
    return Prose(first[2:].strip(), " ".join(summary.split()), more.strip())


def _demoted(markdown: str, levels: int) -> str:
    """``markdown`` with every heading ``levels`` deeper (code fences left alone)."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        out.append("#" * levels + line if not fenced and re.match(r"#+ ", line) else line)
    return "\n".join(out)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("\n", " ").replace("|", "\\|") for cell in cells) + " |"


def series_table(patches: Sequence[Patch]) -> str:
    rows = ["| order | id | what it is (its section below) | how it reaches vLLM | seed 000's measured effect | off switch | tests |",
            "|---|---|---|---|---|---|---|"]
    rows += [_row([str(p.order), f"`{p.id}`", prose(p).title, _reach(p), p.seed_effect, f"`{p.env_switch}`", p.tests])
             for p in patches]
    return "\n".join(rows)


def _reach(patch: Patch) -> str:
    if patch.verdict == "plugin":
        return f"plugin: `{patch.registers}`"
    return f"diff ({len(patch.touches)} file{'s' if len(patch.touches) > 1 else ''})"


def absorbed_table(absorbed: Sequence[Absorbed]) -> str:
    """The patches vLLM made unnecessary, with what fixed them and the test on stock vLLM."""
    rows = ["| id | fixed upstream in | by | seed 000's measured effect | the test on stock vLLM |", "|---|---|---|---|---|"]
    rows += [_row([f"`{a.id}`", a.since, a.fixed_by, a.seed_effect, a.tests]) for a in absorbed]
    return "\n".join(rows)


COVERAGE_HEADINGS = {"vllm_cpu": "vLLM's own code, run on the CPU", "gpu": "on a GPU",
                     "stand_in": "stand-ins, and why", "gap": "what no test drives"}


def coverage_table(patches: Sequence[Patch]) -> str:
    names = [f.name for f in fields(Coverage)]
    rows = ["| id | " + " | ".join(COVERAGE_HEADINGS[n] for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    rows += [_row([p.id, *(getattr(p.coverage, n) for n in names)]) for p in patches]
    return "\n".join(rows)


def readme_sections(patches: Sequence[Patch]) -> str:
    """One section a patch for the patches README: its prose and its facts."""
    parts = []
    for p in patches:
        text = prose(p)
        facts = [f"- off: `{p.env_switch}`" + (f" (default `{p.switch.default}`)" if p.switch.default != p.switch_off
                                                else " (off by default)"),
                 f"- hooks: {', '.join(f'`{h}`' for h in p.hooks)}",
                 (f"- registered by flashnext's vLLM plugin: `{p.registers}`" if p.verdict == "plugin"
                  else f"- touches: {', '.join(f'`{t}`' for t in p.touches)}\n- a diff, not a plugin: {p.why_diff}"),
                 f"- seed item: {p.seed or 'none (not a seed 000 item of its own)'}",
                 f"- upstream: {p.upstream}"]
        parts.append(f"### {p.order}. `{p.id}`: {text.title}\n\n{text.summary}\n\n" + "\n".join(facts))
    return "\n\n".join(parts)


def serving_doc_sections(patches: Sequence[Patch]) -> str:
    """One ``##`` section a patch for docs/serving.md: its whole prose."""
    parts = []
    for p in patches:
        text = prose(p)
        body = text.summary + (f"\n\n{_demoted(text.more, 1)}" if text.more else "")
        parts.append(f"## {text.title} (patch `{p.id}`)\n\n{body}\n\nOff: `{p.env_switch}`. Tests: {p.tests}")
    return "\n\n".join(parts)


def readme_list(patches: Sequence[Patch]) -> str:
    """The top README's list of the series, in order."""
    ids = [p.id for p in patches]
    listed = (", ".join(ids[:-1]) + " and " + ids[-1] if len(ids) > 1 else "".join(ids)) + "."
    return textwrap.fill(listed, 100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)


def begin_marker(name: str) -> str:
    return f"<!-- generated from serving/patches ({name}): flashnext patches readme --write -->"


def end_marker(name: str) -> str:
    return f"<!-- end of the generated {name} -->"


def with_generated(text: str, name: str, body: str, where: Path) -> str:
    """``text`` with what lies between ``name``'s markers replaced by ``body``; each marker is on
    a line of its own, and indented as the marker is."""
    pattern = re.compile(rf"^([ \t]*){re.escape(begin_marker(name))}\n.*?^[ \t]*{re.escape(end_marker(name))}$",
                         re.S | re.M)
    found = pattern.findall(text)
    if len(found) != 1:
        raise FlashnextError(f"{where}: the markers of the generated {name} must be there once ({begin_marker(name)})")
    indent = found[0]
    return pattern.sub(lambda m: f"{indent}{begin_marker(name)}\n{body}\n{indent}{end_marker(name)}", text)


# each generated file: its generated parts, by marker name, in the order they appear
PARTS: dict[Path, dict[str, Callable[[Sequence[Patch]], str]]] = {
    PATCHES_README: {"absorbed table": lambda _: absorbed_table(ABSORBED), "series table": series_table,
                     "coverage table": coverage_table, "patch sections": readme_sections},
    SERVING_DOC: {"patch sections": serving_doc_sections},
    TOP_README: {"patch list": readme_list},
}


def wanted(patches: Sequence[Patch]) -> dict[Path, tuple[str, str]]:
    """Each generated file's current text and the text it should have (an installed package has
    only the patches README)."""
    out = {}
    for path, parts in PARTS.items():
        if not path.is_file():
            continue
        current = path.read_text(encoding="utf-8")
        text = current
        for name, render in parts.items():
            text = with_generated(text, name, render(patches), path)
        out[path] = (current, text)
    return out


def listing(patch: Patch) -> dict:
    """What ``flashnext patches list --json`` says of a patch: its facts and prose, not its probe."""
    text = prose(patch)
    return {"order": patch.order, "id": patch.id, "file": patch.file, "title": text.title, "summary": text.summary,
            "seed": patch.seed, "seed_effect": patch.seed_effect, "env_switch": patch.env_switch,
            "touches": list(patch.touches), "hooks": list(patch.hooks), "upstream": patch.upstream,
            "tests": patch.tests, "coverage": {f.name: getattr(patch.coverage, f.name) for f in fields(Coverage)}}
