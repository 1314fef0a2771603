"""The project's promises to a new user: the README's commands, CI, the manifest schema."""

import json
import re

import jsonschema

from support import ROOT


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(?:bash|sh)\n(.+?)\n```", setup, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands)
    assert "demo-checkpoint" in commands[0] and "make-mtp-int4" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci.splitlines()


def test_overlay_manifest_matches_its_schema(demo_overlay):
    schema = json.loads((ROOT / "manifests" / "overlay.schema.json").read_text())
    jsonschema.validate(json.loads((demo_overlay / "overlay.json").read_text()), schema)


def test_manifests_are_json():
    for path in (ROOT / "manifests").glob("*.json"):
        json.loads(path.read_text())


def test_one_vllm_release_throughout():
    """The vLLM manifest, the serving image's base, the image serve names and the release the series
    is cut against are one release (a port to the next one moves them together)."""
    from flashnext.serving.compose import BASE_IMAGE
    from flashnext.serving.patches.series import VLLM_VERSION

    [manifest] = (ROOT / "manifests").glob("vllm-*.json")
    release = json.loads(manifest.read_text())
    assert manifest.name == f"vllm-{VLLM_VERSION}.json" and release["version"] == VLLM_VERSION
    assert release["image"] == BASE_IMAGE
    bases = re.findall(r"^FROM (\S+)", (ROOT / "serving" / "Dockerfile").read_text(), re.M)
    assert bases == [BASE_IMAGE]


def test_commands_do_not_import_each_other():
    """A command is a thin layer over the library; what two commands share lives in the library
    (or, for printing, in ``tools/_common.py``), never in another command."""
    import ast

    for path in sorted((ROOT / "tools").glob("*.py")):
        if path.name in ("cli.py", "__init__.py", "_common.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flashnext.tools"):
                assert node.module == "flashnext.tools._common", f"{path.name} imports {node.module}"
