"""overlay upload / fetch with huggingface_hub's real client against a Hub stand-in on loopback."""

import json
import os

import pytest
from click.testing import CliRunner

from flashnext.errors import FlashnextError
from flashnext.quant.overlays.hub import fetch_overlay, upload_overlay
from flashnext.tools.cli import main as cli
from support.hub_server import HubServer

TOKEN = "hf_flashnext_test_token_0123456789"
REPO = "flashnext-test/mtp-int4"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    # The stand-in speaks the LFS protocol, not Xet's content-addressed store.
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    with HubServer(TOKEN) as server:
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
    with pytest.raises(FlashnextError, match="run the same command again"):
        upload_overlay(overlay, REPO, endpoint=hub.endpoint)
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
    (REPO, "the Hub cannot be reached"),  # nothing listens on port 9, and the cache is empty
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
