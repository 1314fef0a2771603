"""docs/extending.md's recipes, each claim a test: what the page says to write is what the registries
accept and what the commands then see, and every path and name it gives is in the tree.

The quantizer recipe is run by tests/quant/quantizers/test_quantizer_registry.py; layering and the
architecture's paths by tests/test_docs.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import subprocess
import sys
import types

import pytest
from click.testing import CliRunner

from flashnext import envs
from flashnext.errors import FlashnextError
from flashnext.quant.overlays import builder as overlay_builder
from support import ROOT

PAGE = ROOT / "docs" / "extending.md"
REPO = "someone/toy-overlay"


def page() -> str:
    return PAGE.read_text()


def section(title: str) -> str:
    text = page()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


# ---- paths and names -------------------------------------------------------------------------------

ROOTED_PATH = re.compile(r"`((?:quant|serving|tools|flashnext|manifests|docs|tests|benchmarks)/[\w./<>-]*)`")


def exists(name: str) -> bool:
    pattern = re.sub(r"<[^>]+>|NAME", "*", name.split("::")[0])
    return any(True for _ in ROOT.glob(pattern))


def test_every_path_the_page_names_exists():
    names = sorted({m[1] for m in ROOTED_PATH.finditer(page())})
    assert len(names) > 20, names
    assert [n for n in names if not exists(n)] == []


def test_every_file_of_the_folder_table_is_in_its_folder():
    rows = [line for line in page().splitlines() if line.startswith("| `")]
    checked = 0
    for row in rows:
        folder, holds = row.strip("|").split("|")[:2]
        (first,) = re.findall(r"`([^`]+/)`", folder)[:1] or [None]
        if first is None:
            continue
        for name in re.findall(r"`([\w/]+(?:\.py|/))`", holds):
            if ROOTED_PATH.fullmatch(f"`{name}`"):
                continue  # a path from the root, which the test above checks
            assert (ROOT / first / name).exists(), f"{first}{name}"
            checked += 1
    assert checked >= 15


# Each Python name the page gives, in the module it is found in.
NAMES = [
    ("flashnext.quant.overlays.builder", "OverlayBuilder"),
    ("flashnext.quant.overlays.builder", "OVERLAY_KINDS"),
    ("flashnext.quant.overlays.builder", "OverlayKind"),
    ("flashnext.quant.overlays.builder", "builder_for_kind"),
    ("flashnext.quant.formats.ct_config", "quantization_holder"),
    ("flashnext.tools.overlay", "card_serving"),
    ("flashnext.serving.patches.series", "SERIES"),
    ("flashnext.serving.patches.series", "Patch"),
    ("flashnext.serving.patches.series", "Coverage"),
    ("flashnext.serving.patch_series", "load_series"),
    ("flashnext.envs", "EnvVar"),
    ("flashnext.envs", "ALL"),
    ("flashnext.serving.profiles", "Profile"),
    ("flashnext.serving.capacity", "FAMILIES"),
    ("flashnext.serving.capacity.qwen4_exp", "plan_profile"),
]


@pytest.mark.parametrize(("module", "name"), NAMES, ids=[n for _, n in NAMES])
def test_every_name_the_page_gives_imports(module, name):
    import importlib

    assert re.search(rf"\b{re.escape(name)}\b", page()), f"the page no longer names {name}"
    assert hasattr(importlib.import_module(module), name)


def test_the_page_links_the_architecture_and_the_digest():
    assert "docs/architecture.md" in page() and "docs/seed-000.md" in page()


# ---- an overlay builder ----------------------------------------------------------------------------

def builder_recipe() -> str:
    (block,) = re.findall(r"```python\n(.*?)```", section("An overlay builder"), flags=re.S)
    return block


@pytest.fixture
def recipe_builder(monkeypatch):
    """The page's builder block run as a module of its own; defining the class registers its kind,
    which leaves the registry with the test."""
    module = types.ModuleType("my_package.my_builder")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(builder_recipe(), "docs/extending.md", "exec"), module.__dict__)
    cls = module.__dict__["MyBuilder"]
    (kind,) = cls.kinds
    yield kind.name, cls
    overlay_builder.OVERLAY_KINDS.unregister(cls)


def test_a_builder_registered_as_the_page_says_is_found_by_its_kind(recipe_builder):
    kind, cls = recipe_builder
    assert overlay_builder.builder_for_kind(kind) is cls
    assert overlay_builder.builder_for_kind("no-such-kind") is None
    assert kind in overlay_builder.OVERLAY_KINDS
    assert builder_recipe().count(f'"{kind}"') == 1, "the page writes the kind's name more than once"


def test_a_builder_registered_as_the_page_says_is_on_the_model_card(recipe_builder, demo_overlay):
    import yaml

    from flashnext.quant.overlays.hub import render_model_card
    from flashnext.quant.overlays.manifest import OverlayManifest
    from flashnext.tools.overlay import card_serving

    kind, cls = recipe_builder
    manifest = OverlayManifest.load(demo_overlay).model_copy(update={"kind": kind})
    card = render_model_card(manifest, REPO, card_serving())
    front = yaml.safe_load(card.split("---")[1])
    assert front["tags"] == ["flashnext", "overlay", "my-kind", "int4"]  # the page's row: card_tags=("int4",)
    assert "\n".join(cls.card_section(manifest.report)) in card
    # no draft method: every profile of the base model's family loads it, so the card serves it
    assert f"flashnext overlay fetch {REPO}" in card and "flashnext serve --profile " in card


def test_a_kind_claimed_twice_is_refused(recipe_builder):
    kind, cls = recipe_builder
    with pytest.raises(ValueError, match=f"claims the overlay kind '{kind}', which .*MyBuilder claims"):
        type("OtherBuilder", (cls,), {"kinds": cls.kinds})
    with pytest.raises(ValueError, match="claims the overlay kind 'twice', which it already claims"):
        type("TwiceBuilder", (cls,), {"kinds": (overlay_builder.OverlayKind("twice"),) * 2})
    assert overlay_builder.builder_for_kind(kind) is cls and overlay_builder.builder_for_kind("twice") is None


def test_every_shipped_kind_is_found_by_the_builder_that_declares_it():
    shipped = {"mtp-int4", "int6-bitplane", "int6-to-int8", "int6-dense", "ple-nvfp4", "ple-fp8"}
    assert shipped <= set(overlay_builder.OVERLAY_KINDS)
    for kind in shipped:
        cls = overlay_builder.builder_for_kind(kind)
        assert cls.__module__.startswith("flashnext.quant.overlays.")
        assert overlay_builder.OVERLAY_KINDS.get(kind) in cls.kinds


def test_reading_overlays_imports_no_builder():
    """What the page says the lazy table is for: manifests and the Hub module load without torch."""
    code = ("import sys, flashnext.quant.overlays.hub, flashnext.quant.overlays.manifest\n"
            "print([m for m in sys.modules if m == 'torch' or m.startswith('flashnext.quant.overlays.') "
            "and m.rsplit('.', 1)[1] not in ('builder', 'hub', 'manifest', 'view')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- a vLLM patch ----------------------------------------------------------------------------------

def toy_probe() -> None:
    """A probe as the page says: a module-level function, found by its module and name."""


def test_a_patch_entry_shaped_as_the_page_says_is_accepted():
    from flashnext.serving.patch_series import load_series
    from flashnext.serving.patches.series import SERIES

    last = max(SERIES, key=lambda p: p.order)
    toy = dataclasses.replace(SERIES[0], id="toy-01", order=last.order + 1, probe=toy_probe)
    assert load_series(patches=(toy, *SERIES))[-1] is toy


def test_a_patch_entry_is_checked_as_the_page_says():
    from flashnext.serving.patch_series import load_series
    from flashnext.serving.patches.series import SERIES

    def not_found_by_name() -> None:
        pass

    with pytest.raises(FlashnextError, match="is not a function of a module"):
        load_series(patches=(dataclasses.replace(SERIES[0], probe=not_found_by_name),))
    with pytest.raises(FlashnextError, match="has no hunk of a unified diff"):
        load_series(patches=(dataclasses.replace(SERIES[0], file="README.md"),))


TOY_TARGET = "vllm/v1/worker/worker_base.py"  # a file no patch of the series touches


def test_a_new_patch_is_three_files(tmp_path, monkeypatch):
    """Issue 39 item 5: the page's three files, written as a developer would (a diff with its prose,
    an entry with its switch, a hook), and nothing else: `patches check` applies it with the series,
    derives its probe from its hunks and passes it; the generated documents carry its prose; its
    switch is read through flashnext.envs by name."""
    pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")
    import difflib

    from flashnext.serving import patch_series
    from flashnext.serving.patches import docs, series

    monkeypatch.setattr(envs, "_declared", list(envs._declared))  # the toy's switch is declared for this test only
    toy_switch = envs.EnvVar("VLLM_TOY_PATCH", "1", "Patch toy-01: 0 turns the toy patch off.")
    hook = tmp_path / "toy_hook.py"  # file 3: the hook (a module of its own; not imported by the check)
    hook.write_text("def called():\n    return 1\n")
    original = (patch_series.installed_vllm_root() / TOY_TARGET).read_text().splitlines(keepends=True)
    patched = [*original[:3], "import toy_hook  # flashnext toy-01\n", *original[3:]]
    diff = "".join(difflib.unified_diff(original, patched, f"a/{TOY_TARGET}", f"b/{TOY_TARGET}"))
    folder = tmp_path / "patches"
    folder.mkdir()
    for p in patch_series.diffs(series.SERIES):  # the series' diffs beside it, where the entries look
        (folder / p.file).write_bytes(p.path.read_bytes())
    (folder / "toy-01.patch").write_text(  # file 1: the prose, then the diff
        "# A toy patch\n\nIt imports a hook at the top of the input batch's module, which is all a toy needs "
        "to show the three files of a new patch.\n\n" + diff)
    monkeypatch.setattr(series, "PATCH_DIR", folder)
    monkeypatch.setattr(patch_series, "PATCH_DIR", folder)
    last = max(series.SERIES, key=lambda p: p.order)
    toy = dataclasses.replace(  # file 2: the entry
        last, id="toy-01", order=last.order + 1, file="toy-01.patch", seed=None, switch=toy_switch, switch_off="0",
        hooks=("flashnext.serving.hooks.pipeline.deferred_intermediate_tensors",), registers=None,
        why_diff="a toy: it shows the files of a new diff, not an extension point")
    rows = patch_series.check_series(series=(*series.SERIES, toy))
    assert rows[-1] == {"id": "toy-01", "verdict": "diff", "applied": True, "compiled": [TOY_TARGET], "probe": "passed"}
    assert toy.touches == (TOY_TARGET,) and envs.VLLM_TOY_PATCH is toy_switch and toy_switch in envs.ALL
    assert docs.prose(toy).title == "A toy patch" and "### 16. `toy-01`: A toy patch" in docs.readme_sections((toy,))


def test_a_declared_switch_needs_no_edit_of_envs_all():
    """Step 3's claim: a switch declared in its series entry is read through ``flashnext.envs`` by
    name and is in ``envs.ALL``, as is every serving variable declared in flashnext/envs.py."""
    declared = [v for v in vars(envs).values() if isinstance(v, envs.EnvVar) and v.kind == envs.SERVING]
    from flashnext.serving.patches.series import SERIES

    switches = {p.switch for p in SERIES}
    assert set(declared) | switches == set(envs.ALL) and not switches & set(declared)
    assert all(getattr(envs, s.name) is s for s in switches)


def test_every_patch_has_the_files_the_page_lists():
    """Step 2's two routes: a diff with its prose before the first file header, or (where vLLM 0.34.0
    offers an extension point) a registration that flashnext's vLLM plugin runs, its prose in
    ``<id>.md``; step 3's entry either way. Nothing else of a patch's is in its folder."""
    from flashnext.serving.patches.series import PATCH_DIR, SERIES

    for p in SERIES:
        if p.verdict == "diff":
            assert p.path.is_file() and p.prose_path == p.path, p.id
        else:
            module, _, name = p.registers.rpartition(".")
            assert p.file is None and callable(getattr(importlib.import_module(module), name)), p.id
        assert p.prose_path.read_text().startswith("# "), p.prose_path
    written = {p.prose_path.name for p in SERIES}
    assert {f.name for f in PATCH_DIR.iterdir() if f.suffix in (".patch", ".md")} == written | {"README.md"}


# ---- a model family for plan -----------------------------------------------------------------------

class ToyPlan:
    def __init__(self, asked):
        self.asked = asked

    def to_json(self) -> dict:
        return {"toy": self.asked}


def test_a_family_registered_in_families_is_what_plan_asks(monkeypatch):
    from flashnext.serving import capacity, profiles
    from flashnext.tools.cli import main as cli

    name = profiles.available()[0]
    shipped = profiles.load_profile(name)
    toy = dataclasses.replace(shipped, model_family="toy_family")
    monkeypatch.setattr(profiles, "load_profile", lambda n, *a, **k: toy if n == name else shipped)
    asked = []

    def toy_planner(profile, kv_cache_memory_bytes=None, prefix_caching=None, model=None):
        asked.append((profile.model_family, kv_cache_memory_bytes, prefix_caching, model))
        return ToyPlan([profile.name, kv_cache_memory_bytes, prefix_caching])

    monkeypatch.setitem(capacity.FAMILIES, "toy_family", toy_planner)
    r = CliRunner().invoke(cli, ["plan", "--profile", name, "--kv-cache-memory-bytes", "123456",
                                 "--no-prefix-caching", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"profile": name, "toy": [name, 123456, False]}
    assert asked == [("toy_family", 123456, False, None)]

    monkeypatch.delitem(capacity.FAMILIES, "toy_family")
    r = CliRunner().invoke(cli, ["plan", "--profile", name, "--json"])
    assert r.exit_code != 0 and "plan models qwen4_exp profiles only" in r.output
