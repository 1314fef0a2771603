"""The patch registry (serving/patches/series.py) against what it names: the diffs and prose beside
it, the hooks and probes it points to, the envs switches, the vLLM pin, and the documents generated
from it."""

import importlib
import inspect
import re
import tomllib

import pytest
from click.testing import CliRunner

from support import ROOT

from flashnext import envs
from flashnext.serving.patch_series import load_series, probe_calls
from flashnext.serving.patches import docs, probes
from flashnext.serving.patches.series import ABSORBED, PATCH_DIR, SERIES, VLLM_VERSION
from flashnext.tools.cli import main as cli


def resolve(dotted: str):
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not module.startswith(e.name):
                raise  # the module exists; something it imports does not
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_ids_are_unique_and_orders_count_up_in_the_listed_order():
    assert len({p.id for p in SERIES}) == len(SERIES)
    assert [p.order for p in SERIES] == list(range(1, len(SERIES) + 1))
    assert [p.id for p in load_series()] == [p.id for p in SERIES]


def test_the_diffs_and_prose_beside_the_registry_are_exactly_its_patches():
    assert {f.stem for f in PATCH_DIR.glob("*.patch")} == {p.id for p in SERIES if p.verdict == "diff"}
    assert {f.stem for f in PATCH_DIR.glob("*.md")} - {"README"} == {p.id for p in SERIES if p.verdict == "plugin"}
    for p in SERIES:
        assert p.file == (f"{p.id}.patch" if p.verdict == "diff" else None)
        text = docs.prose(p)
        assert text.title and len(text.summary) > 80


def test_a_plugin_entry_is_registered_by_flashnexts_vllm_plugin_and_touches_no_file():
    from flashnext.serving import plugin

    plugins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {plugin.PLUGIN_NAME: "flashnext.serving.plugin:register"}
    entries = [p for p in SERIES if p.verdict == "plugin"]
    assert entries and plugin.registrations() == [(p.id, p.registers) for p in entries]
    for p in entries:
        assert p.touches == () and callable(resolve(p.registers)) and p.why_diff is None
    for p in SERIES:  # a diff says why no extension point of vLLM's serves it
        assert p.verdict == "plugin" or len(p.why_diff or "") > 40, p.id


def test_absorbed_patches_left_the_series_with_their_evidence():
    assert not {a.id for a in ABSORBED} & {p.id for p in SERIES}
    for a in ABSORBED:
        assert a.since == VLLM_VERSION and a.fixed_by and a.tests.startswith("`tests/")
        assert not (PATCH_DIR / f"{a.id}.patch").exists()


def test_the_vllm_the_diffs_are_against_is_the_one_installed_and_its_requirements_the_serve_extra():
    """vLLM's own pin flashinfer-python==0.7.3 is not on PyPI, so vLLM is installed without its
    requirements and the serve extra lists them: exactly the wheel's, with that one pin moved."""
    import importlib.metadata

    from flashnext.serving import vllm_release

    assert importlib.metadata.version("vllm") == VLLM_VERSION
    wheel = [r for r in importlib.metadata.requires("vllm") if "extra ==" not in r]
    serve = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    moved = {"flashinfer-python==0.7.3": "flashinfer-python==0.7.4"}
    assert serve == [moved.get(r, r) for r in wheel]
    install = f"pip install --no-deps vllm=={VLLM_VERSION}"
    assert install in vllm_release.INSTALL and install in (ROOT / "README.md").read_text()
    assert install in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("patch", SERIES, ids=[p.id for p in SERIES])
def test_every_hook_a_patch_names_is_importable(patch):
    for hook in patch.hooks:
        assert resolve(hook) is not None, hook
        assert hook.startswith("flashnext.serving.hooks.")


def test_every_probe_is_a_function_of_the_probes_module_and_each_diffs_is_derived_from_it():
    functions = {name for name, f in inspect.getmembers(probes, inspect.isfunction) if f.__module__ == probes.__name__}
    named = [p.probe.__name__ for p in (*SERIES, *ABSORBED) if p.probe is not None]
    assert sorted({*named, "lines_in_tree", "diff_files", "diff_hunks"}) == sorted(functions)
    calls = probe_calls([*SERIES, *ABSORBED])
    for p in (*SERIES, *ABSORBED):
        probe, args = calls[p.id]
        assert probe.__module__ == probes.__name__ and getattr(probes, probe.__name__) is probe
        if getattr(p, "verdict", None) == "diff":  # a diff is described once: by itself
            assert p.probe is None and probe is probes.lines_in_tree and args[0] == p.file, p.id
            added = [(rel, a) for rel, a, _ in probes.diff_hunks(p.path.read_text())]
            assert [rel for rel, _ in args[1]] == [rel for rel, _ in added] and set(p.touches) == {r for r, _ in added}
            assert all(set(kept) <= set(a) for (_, kept), (_, a) in zip(args[1], added)), p.id
    # what a later patch rewrites is not asked of an earlier one: mtp-02 replaces mtp-01's draft embedding
    [(_, (_, mtp01))] = [(i, calls[i][1]) for i in ("mtp-01",)]
    assert not any("self.embed_tokens = VocabParallelEmbedding(" in line for _, kept in mtp01 for line in kept)


def test_a_diffs_derived_probe_refuses_the_stock_tree():
    """The derived probes against a tree the series was not applied to: stock vLLM 0.34.0 as
    installed (the patched tree passes them all: tests/serving/test_patch_series.py)."""
    pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")
    for p in SERIES:
        if p.verdict == "diff":
            probe, args = probe_calls(SERIES)[p.id]
            with pytest.raises(AssertionError, match=rf"hunk \d+ of {re.escape(p.file)} is not in the tree"):
                probe(*args)


def test_every_switch_is_a_serving_variable_of_envs_whose_help_names_its_patch():
    declared = {v.name: v for v in envs.DECLARED}
    assert all(getattr(envs, p.switch.name) is p.switch for p in SERIES)  # read through envs by name
    assert len({p.switch.name for p in SERIES}) == len(SERIES)
    for p in SERIES:
        assert declared[p.switch.name] is p.switch and p.switch in envs.ALL
        assert p.switch.help.startswith(f"Patch {p.id}: "), p.switch.help
    # and every variable whose help names a patch names one of the series
    named = {v.name: re.match(r"Patch ([a-z0-9-]+)", v.help).group(1) for v in envs.DECLARED if v.help.startswith("Patch ")}
    assert set(named.values()) <= {p.id for p in SERIES}, named


def test_the_generated_documents_are_up_to_date():
    for path, (current, text) in docs.wanted(SERIES).items():
        assert current == text, f"{path}: run `flashnext patches readme --write`"
    assert set(docs.wanted(SERIES)) == set(docs.PARTS)  # a source checkout has them all
    result = CliRunner().invoke(cli, ["patches", "readme"])
    # Two tables: a header and a rule each, one row a patch, one blank line between them.
    assert result.exit_code == 0 and result.output.count("\n") == 2 * (len(SERIES) + 2) + 1


def test_the_readme_and_the_docs_list_every_patch_in_order():
    readme = (ROOT / "README.md").read_text()
    listed = readme.split(docs.begin_marker("patch list"), 1)[1].split(docs.end_marker("patch list"), 1)[0]
    assert re.split(r",\s*|\s+and\s+", " ".join(listed.split()).rstrip(".")) == [p.id for p in SERIES]
    for path, heading in ((docs.SERVING_DOC, r"^## .* \(patch `([a-z0-9-]+)`\)$"),
                          (docs.PATCHES_README, r"^### \d+\. `([a-z0-9-]+)`: ")):
        assert re.findall(heading, path.read_text(), re.M) == [p.id for p in SERIES], path
    table = docs.PATCHES_README.read_text()
    for p in SERIES:
        assert f"| {p.id} | {p.coverage.vllm_cpu} |" in table


def test_the_list_command_reads_the_registry():
    import json

    listing = CliRunner().invoke(cli, ["patches", "list", "--json"])
    assert listing.exit_code == 0
    rows = json.loads(listing.stdout)
    assert [(r["id"], r["env_switch"]) for r in rows] == [(p.id, f"{p.switch.name}={p.switch_off}") for p in SERIES]
