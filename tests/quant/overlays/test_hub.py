"""overlay upload / fetch with huggingface_hub's real client against a Hub stand-in on loopback."""

import json
import os
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

from flashnext.errors import FlashnextError
from flashnext.quant.overlays.hub import fetch_overlay, upload_overlay
from flashnext.tools.cli import main as cli
from support.hub_server import hub_on_loopback

TOKEN = "hf_flashnext_test_token_0123456789"
REPO = "flashnext-test/mtp-int4"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with hub_on_loopback(monkeypatch, tmp_path, TOKEN) as server:
        yield server


def cli_run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_dry_run_lists_files_and_contacts_nobody(demo_overlay):
    result = cli_run("overlay", "upload", demo_overlay, "--repo", REPO, "--dry-run", "--json",
                     "--endpoint", "http://127.0.0.1:9")  # nothing listens there
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    names = [f["path"] for f in plan["files"]]
    assert names == ["model-00005-of-00005.safetensors", "model.safetensors.index.json", "config.json",
                     "overlay.json", "README.md"]
    assert plan["files"][0]["size"] == (demo_overlay / names[0]).stat().st_size
    assert not (demo_overlay / "overlay.published.json").exists()


def test_upload_then_fetch_round_trip(hub, demo_snapshot, demo_overlay, tmp_path):
    overlay = tmp_path / "ov"
    import shutil

    shutil.copytree(demo_overlay, overlay)
    result = cli_run("overlay", "upload", overlay, "--repo", REPO, "--private", "--endpoint", hub.endpoint, "--json")
    assert result.exit_code == 0, result.output
    assert TOKEN not in result.output
    info = json.loads(result.stdout)
    repo = hub.state.repos[REPO]
    assert repo.private and repo.branches["main"] == info["commit"]
    tree = repo.commits[info["commit"]]
    assert set(tree) == {".gitattributes", "README.md", "overlay.json", "config.json",
                         "model.safetensors.index.json", "model-00005-of-00005.safetensors"}
    assert tree["model-00005-of-00005.safetensors"] == (overlay / "model-00005-of-00005.safetensors").read_bytes()
    card = tree["README.md"].decode()
    assert card.startswith("---\n") and "mtp-int4" in card and "| gate |" in card and "overlay fetch" in card
    published = json.loads((overlay / "overlay.published.json").read_text())
    assert published["commit"] == info["commit"] and published["repo_id"] == REPO
    for path in overlay.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes()
    # The exact conversation: every call but the presigned LFS PUTs carried the token (the server
    # refuses any that does not), and only the files listed by the dry run went up.
    calls = [(m, p.split("?")[0]) for m, p in hub.state.log if not p.startswith("/api/agent-harnesses")]
    assert calls[:3] == [("POST", "/api/repos/create"), ("POST", "/api/validate-yaml"),
                         ("POST", f"/api/models/{REPO}/preupload/main")]
    assert calls[3] == ("POST", f"/{REPO}.git/info/lfs/objects/batch")
    puts = [p for m, p in calls if m == "PUT"]
    assert len(puts) == 5 and all(p.startswith("/lfs-upload/") for p in puts)
    assert calls[-1] == ("POST", f"/api/models/{REPO}/commit/main")

    view = tmp_path / "view"
    result = cli_run("overlay", "fetch", REPO, "--base", demo_snapshot, "--out", view,
                     "--endpoint", hub.endpoint, "--cache-dir", tmp_path / "cache")
    assert result.exit_code == 0, result.output
    assert (view / "model-00005-of-00005.safetensors").read_bytes() == (
        overlay / "model-00005-of-00005.safetensors").read_bytes()
    assert cli_run("overlay", "verify", view).exit_code == 0


def test_branch_revision(hub, demo_overlay, tmp_path):
    import shutil

    overlay = tmp_path / "ov"
    shutil.copytree(demo_overlay, overlay)
    info = upload_overlay(overlay, REPO, revision="g64", endpoint=hub.endpoint)
    repo = hub.state.repos[REPO]
    assert repo.branches["g64"] == info["commit"] and repo.branches["main"] != info["commit"]


def test_interrupted_upload_resumes(hub, demo_overlay, tmp_path):
    import hashlib
    import shutil

    overlay = tmp_path / "ov"
    shutil.copytree(demo_overlay, overlay)
    shard_oid = hashlib.sha256((overlay / "model-00005-of-00005.safetensors").read_bytes()).hexdigest()
    hub.state.fail_oids.add(shard_oid)  # the connection drops midway through the big file, every try
    with pytest.raises(FlashnextError, match="was interrupted") as interrupted:
        upload_overlay(overlay, REPO, endpoint=hub.endpoint)
    assert interrupted.value.reason == "interrupted" and interrupted.value.status == 500
    assert shard_oid not in hub.state.lfs and len(hub.state.lfs) >= 1
    assert not (overlay / "overlay.published.json").exists()
    stored_before = set(hub.state.lfs)
    first_run = len(hub.state.log)
    hub.state.fail_oids.clear()
    info = upload_overlay(overlay, REPO, endpoint=hub.endpoint)
    sent_again = [p.rsplit("/", 1)[1].split("?")[0] for m, p in hub.state.log[first_run:] if m == "PUT"]
    assert sent_again == [shard_oid], "only the object the interrupted run did not store is sent"
    assert stored_before < set(hub.state.lfs)
    assert hub.state.repos[REPO].branches["main"] == info["commit"]


def test_fetch_of_a_tampered_file_is_refused(hub, demo_snapshot, demo_overlay, tmp_path):
    import shutil

    overlay = tmp_path / "ov"
    shutil.copytree(demo_overlay, overlay)
    upload_overlay(overlay, REPO, endpoint=hub.endpoint)
    hub.state.tamper(REPO, "config.json", b'{"tampered": true}' + b" " * 2000)
    view = tmp_path / "view"
    with pytest.raises(FlashnextError) as err:
        fetch_overlay(REPO, demo_snapshot, view, endpoint=hub.endpoint, cache_dir=tmp_path / "cache")
    assert "config.json" in str(err.value)
    assert not view.exists()


def test_wrong_token_is_one_clear_line(hub, demo_overlay, tmp_path, monkeypatch):
    import shutil

    overlay = tmp_path / "ov"
    shutil.copytree(demo_overlay, overlay)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    result = cli_run("overlay", "upload", overlay, "--repo", REPO, "--endpoint", hub.endpoint)
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1 and "401" in result.output
    assert "hf_wrong" not in result.output


def test_symlinks_are_refused(demo_overlay, tmp_path):
    import shutil

    overlay = tmp_path / "ov"
    shutil.copytree(demo_overlay, overlay)
    target = overlay / "config.json"
    moved = tmp_path / "config.json"
    target.rename(moved)
    os.symlink(moved, target)
    result = cli_run("overlay", "upload", overlay, "--repo", REPO, "--dry-run")
    assert result.exit_code == 1 and "symlink" in result.output


@pytest.mark.parametrize("repo, message", [
    (REPO, "the Hub at http://127.0.0.1:9 cannot be reached"),  # nothing listens on port 9, and the cache is empty
    ("not/a/valid/id", "is not a valid repository id"),
], ids=["offline", "bad-id"])
def test_fetch_failures_are_one_line(demo_snapshot, tmp_path, monkeypatch, repo, message):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    view = tmp_path / "view"
    result = cli_run("overlay", "fetch", repo, "--base", demo_snapshot, "--out", view,
                     "--endpoint", "http://127.0.0.1:9", "--cache-dir", tmp_path / "cache")
    assert result.exit_code == 1 and result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not view.exists()


def test_fetch_of_a_hostile_manifest_is_refused(hub, demo_snapshot, demo_overlay, tmp_path):
    """A repo whose overlay.json names a file outside the overlay: refused before anything is linked."""
    import shutil

    overlay = tmp_path / "ov"
    shutil.copytree(demo_overlay, overlay)
    upload_overlay(overlay, REPO, endpoint=hub.endpoint)
    manifest = json.loads((overlay / "overlay.json").read_text())
    manifest["adds"].append({"path": "../../../../outside", "sha256": "0" * 64, "size": 0})
    hub.state.tamper(REPO, "overlay.json", json.dumps(manifest).encode())
    view = tmp_path / "view"
    result = cli_run("overlay", "fetch", REPO, "--base", demo_snapshot, "--out", view, "--endpoint", hub.endpoint,
                     "--cache-dir", tmp_path / "cache")
    # huggingface_hub's download bar comes first; then one line says why it stops.
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 1 and len(errors) == 1 and "does not stay inside" in errors[0]
    assert result.output.rstrip().endswith(errors[0])
    assert not view.exists() and not (tmp_path / "outside").exists()


# --- issue 32: every Hub failure is data in the library and one line with what to do at the CLI --

REFUSED = "http://127.0.0.1:9"  # nothing listens there


@dataclass(frozen=True)
class HubFailure:
    id: str
    verb: str  # upload | fetch
    token: str | None  # HF_TOKEN, None: unset
    repo: str
    endpoint: str | None  # None: the stand-in's
    reason: str
    status: int | None
    message: str  # in the library's line
    hint: str  # added by the command line
    env: tuple = ()
    args: tuple = ()


HUB_FAILURES = [
    HubFailure("upload-wrong-token", "upload", "hf_wrong", REPO, None, "unauthorized", 401,
               "refused the token (HTTP 401)", "log in again with `hf auth login`, or set HF_TOKEN"),
    HubFailure("upload-no-token", "upload", None, REPO, None, "no-token", 401,
               "wants a token, and none is set", "`hf auth login`, or set HF_TOKEN"),
    HubFailure("upload-refused-port", "upload", TOKEN, REPO, REFUSED, "unreachable", None,
               f"the Hub at {REFUSED} cannot be reached (ConnectError",
               "check the network, and HF_ENDPOINT or --endpoint"),
    HubFailure("fetch-missing-repo", "fetch", TOKEN, "flashnext-test/missing", None, "repo-not-found", 404,
               "flashnext-test/missing does not exist", "check the repository id"),
    HubFailure("fetch-wrong-token", "fetch", "hf_wrong", REPO, None, "unauthorized", 401,
               "refused the token (HTTP 401)", "`hf auth login`"),
    HubFailure("fetch-missing-revision", "fetch", TOKEN, REPO, None, "revision-not-found", 404,
               "has no such revision", "check --revision", args=("--revision", "nope")),
    HubFailure("fetch-refused-port", "fetch", TOKEN, REPO, REFUSED, "unreachable", None,
               "cannot be reached (ConnectError", "check the network"),
    HubFailure("fetch-offline", "fetch", TOKEN, REPO, REFUSED, "offline", None,
               "offline mode (HF_HUB_OFFLINE is set)", "unset HF_HUB_OFFLINE", env=(("HF_HUB_OFFLINE", "1"),)),
]


def _hub_failure_argv(case: HubFailure, hub, overlay, snapshot, tmp_path) -> list:
    endpoint = case.endpoint or hub.endpoint
    if case.verb == "upload":
        return ["overlay", "upload", overlay, "--repo", case.repo, "--endpoint", endpoint, *case.args]
    return ["overlay", "fetch", case.repo, "--base", snapshot, "--out", tmp_path / "view", "--endpoint", endpoint,
            "--cache-dir", tmp_path / "cache", *case.args]


@pytest.fixture
def failing_hub(hub, demo_snapshot, demo_overlay, tmp_path, monkeypatch):
    import shutil

    import huggingface_hub.constants as constants

    seed, overlay = tmp_path / "seed", tmp_path / "ov"
    shutil.copytree(demo_overlay, seed)
    shutil.copytree(demo_overlay, overlay)
    upload_overlay(seed, REPO, endpoint=hub.endpoint)  # a real overlay repo to fail on

    def arm(case: HubFailure) -> list:
        if case.token is None:
            monkeypatch.delenv("HF_TOKEN")
        else:
            monkeypatch.setenv("HF_TOKEN", case.token)
        for name, value in case.env:
            monkeypatch.setenv(name, value)
            if name == "HF_HUB_OFFLINE":  # read once, at import
                monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        return _hub_failure_argv(case, hub, overlay, demo_snapshot, tmp_path)

    return arm, overlay, tmp_path


@pytest.mark.parametrize("case", HUB_FAILURES, ids=lambda c: c.id)
def test_hub_failure_is_data(case: HubFailure, failing_hub):
    """The library's error says what failed, where and with which status; it adds no advice."""
    from flashnext.quant.overlays.hub import HubError

    arm, overlay, tmp_path = failing_hub
    argv = arm(case)
    endpoint = str(argv[argv.index("--endpoint") + 1])
    with pytest.raises(HubError) as failed:
        if case.verb == "upload":
            upload_overlay(overlay, case.repo, endpoint=endpoint)
        else:
            revision = case.args[1] if case.args else None
            fetch_overlay(case.repo, argv[4], tmp_path / "view", revision=revision, endpoint=endpoint,
                          cache_dir=tmp_path / "cache")
    e = failed.value
    assert (e.reason, e.status, e.repo_id, e.endpoint) == (case.reason, case.status, case.repo, endpoint)
    assert case.message in str(e) and case.hint not in str(e)
    assert not (tmp_path / "view").exists() and not (overlay / "overlay.published.json").exists()


@pytest.mark.parametrize("case", HUB_FAILURES, ids=lambda c: c.id)
def test_hub_failure_is_one_line_with_what_to_do(case: HubFailure, failing_hub):
    arm, overlay, tmp_path = failing_hub
    result = cli_run(*arm(case))
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert case.message in lines[0] and case.hint in lines[0], lines[0]
    assert "hf_wrong" not in result.output and TOKEN not in result.output
    assert not (tmp_path / "view").exists() and not (overlay / "overlay.published.json").exists()


def test_every_hub_failure_reason_has_what_to_do():
    from flashnext.quant.overlays.hub import HUB_FAILURE_REASONS
    from flashnext.tools.overlay import HUB_HINTS

    assert set(HUB_HINTS) == set(HUB_FAILURE_REASONS)


def _base_dependency_modules() -> set[str]:
    """The top-level modules flashnext may import: its own, the standard library's and those of the
    distributions pyproject.toml's ``dependencies`` names."""
    import importlib.metadata
    import re
    import sys
    import tomllib

    from support import ROOT

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    allowed = {"flashnext", *sys.stdlib_module_names}
    for module, dists in importlib.metadata.packages_distributions().items():
        if any(d.lower().replace("_", "-") in wanted for d in dists):
            allowed.add(module)
    return allowed


@pytest.mark.parametrize("case", [c for c in HUB_FAILURES if c.reason in ("unauthorized", "unreachable")],
                         ids=lambda c: c.id)
def test_hub_failures_import_only_base_dependencies(case: HubFailure, failing_hub, monkeypatch):
    """A base install has huggingface_hub's HTTP client only as huggingface_hub's own dependency
    (httpx2 today, httpx or requests before): flashnext's code imports none of them, by statement or
    by name, on the way to the error."""
    import builtins
    import importlib

    arm, _, _ = failing_hub
    argv = arm(case)
    imported: list[tuple[str, str]] = []
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def record(importer: str, name: str) -> None:
        if importer.startswith("flashnext"):
            imported.append((importer, name.partition(".")[0]))

    def spy_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0:
            record((globals or {}).get("__name__", ""), name)
        return real_import(name, globals, locals, fromlist, level)

    def spy_import_module(name, package=None):
        import sys

        if not name.startswith("."):
            record(sys._getframe(1).f_globals.get("__name__", ""), name)
        return real_import_module(name, package)

    monkeypatch.setattr(builtins, "__import__", spy_import)
    monkeypatch.setattr(importlib, "import_module", spy_import_module)
    result = cli_run(*argv)
    monkeypatch.undo()
    assert result.exit_code == 1, result.output
    allowed = _base_dependency_modules()
    assert not [(who, what) for who, what in imported if what not in allowed]


# --- issue 32: a model card that can be followed ------------------------------------------------

def card_commands(card: str) -> list[list[str]]:
    """The command lines of the card's ``bash`` blocks, split as a shell would."""
    import shlex

    commands, inside = [], False
    for line in card.splitlines():
        if line.startswith("```"):
            inside = line == "```bash"
            continue
        if inside and line.strip() and not line.lstrip().startswith("#"):
            commands.append(shlex.split(line))
    return commands


def parse_with_flashnext(argv: list[str]):
    """``flashnext ARGV`` parsed by flashnext's own click CLI down to its last subcommand, running
    nothing (a usage error raises click's)."""
    import click

    from flashnext.tools.cli import main

    command, name, args = main, "flashnext", list(argv)
    while True:
        ctx = command.make_context(name, args)
        rest = [*getattr(ctx, "_protected_args", ()), *ctx.args]
        if not isinstance(command, click.Group) or not rest:
            return command, ctx
        name, command, args = command.resolve_command(ctx, rest)


def _speculative_method(profile_json: dict) -> str | None:
    args = profile_json["vllm_args"]
    if "--speculative-config" not in args:
        return None
    return json.loads(args[args.index("--speculative-config") + 1])["method"]


@dataclass(frozen=True)
class CardCase:
    kind: str
    profiles: tuple[str, ...]  # the profiles the card must name


CARD_CASES = [
    CardCase("mtp-int4", ("3x3090-mtp",)),  # the draft head: only the profile that speculates with it
    CardCase("int6-bitplane", ("3x3090", "3x3090-mtp")),
    CardCase("some-future-kind", ("3x3090", "3x3090-mtp")),
]


@pytest.mark.parametrize("case", CARD_CASES, ids=lambda c: c.kind)
def test_model_card_can_be_followed(case: CardCase, demo_overlay):
    """Every command of the card's Use section is flashnext's and parses with its own CLI; none
    needs an index flashnext is not on, or a vLLM without the series; the profile named exists and
    serves the overlay's kind."""
    from flashnext.quant.overlays.hub import render_model_card
    from flashnext.quant.overlays.manifest import OverlayManifest
    from flashnext.serving.profiles import PROFILE_DIR
    from flashnext.tools.overlay import card_serving

    manifest = OverlayManifest.load(demo_overlay).model_copy(update={"kind": case.kind})
    card = render_model_card(manifest, REPO, card_serving())
    commands = card_commands(card.split("## Use", 1)[1])
    assert commands, card
    parsed = {}
    for argv in commands:
        if argv[0] == "pip":  # from the clone: flashnext is on no index
            assert argv[1] == "install" and argv[-1].startswith(("./", "/")), argv
            continue
        assert argv[0] == "flashnext", f"{argv}: not a flashnext command"
        command, ctx = parse_with_flashnext(argv[1:])
        parsed[command.name] = ctx.params
    assert {"fetch", "serve"} <= set(parsed), commands
    assert parsed["fetch"]["repo_id"] == REPO
    serve = parsed["serve"]
    profile = json.loads((PROFILE_DIR / f"{serve['profile']}.json").read_text())
    assert serve["profile"] == case.profiles[0] and all(f"`{name}`" in card for name in case.profiles)
    assert profile["model_family"] == "qwen4_exp"
    if case.kind == "mtp-int4":
        assert _speculative_method(profile) == "mtp"
    if profile["uses_ple_table"]:
        assert serve["ple_table"] is not None and "build" in parsed
    assert serve["overlays"] and serve["model"] == parsed["fetch"]["base"]


def test_a_card_without_serve_facts_says_how_to_fetch_only(demo_overlay):
    """The library renders the card from what its caller hands in: with no serving facts it names
    no profile, no image and no serve command, and every command left still parses."""
    from flashnext.quant.overlays.hub import render_model_card
    from flashnext.quant.overlays.manifest import OverlayManifest
    from flashnext.tools.overlay import card_serving

    manifest = OverlayManifest.load(demo_overlay)
    bare = render_model_card(manifest, REPO)
    full = render_model_card(manifest, REPO, card_serving())
    use = bare.split("## Use", 1)[1]
    assert "flashnext serve" not in use and "profile" not in use and card_serving().image not in use
    assert [argv[:3] for argv in card_commands(use)] == [["pip", "install", "-e"], ["flashnext", "overlay", "fetch"]]
    for argv in card_commands(use)[1:]:
        parse_with_flashnext(argv[1:])
    assert bare.split("## Use", 1)[0] == full.split("## Use", 1)[0]


SPECULATIVE_FORMS = [
    ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
    ['--speculative-config={"method": "mtp", "num_speculative_tokens": 1}'],
    ["-sc", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'],
    ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
     "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'],
    [],
]


def test_the_cards_reading_of_the_speculative_method_is_vllms():
    """The card reads a profile's speculative method without vLLM (upload runs on a base install);
    the parser of vLLM 0.34.0's ``vllm serve``, given the command the profile runs, reads the same
    from every shipped profile and from each form of the flag."""
    import dataclasses

    from flashnext.serving.capacity.shape import import_vllm
    from flashnext.serving.compose import vllm_command
    from flashnext.serving.profiles import available, load_profile, speculative_method

    import_vllm()  # vLLM for parsing only: no device
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    shipped = [load_profile(name) for name in available()]
    base = shipped[0]
    variants = [dataclasses.replace(base, vllm_args=[*base.vllm_args[:2], *form]) for form in SPECULATIVE_FORMS]
    for profile in shipped + variants:
        served = parser.parse_args(vllm_command(profile, "/models/view", "0.0.0.0", 8000)[2:])
        assert speculative_method(profile) == (served.speculative_config or {}).get("method"), profile.vllm_args
    assert {speculative_method(p) for p in shipped} >= {None, "mtp"}


def test_a_speculative_config_it_cannot_read_is_refused():
    import dataclasses

    from flashnext.serving.profiles import available, load_profile, speculative_method

    base = load_profile(available()[0])
    for args, message in ((["--speculative-config.method", "mtp"], "is not read here"),
                          (["--speculative_config", '{"method": "mtp"}'], "is not read here"),
                          (["--speculative-config", "{mtp"], "is not JSON"),
                          (["--speculative-config"], "has no value")):
        with pytest.raises(FlashnextError, match=message):
            speculative_method(dataclasses.replace(base, vllm_args=args))
