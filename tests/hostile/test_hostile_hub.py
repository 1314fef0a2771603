"""Issue 26, class 3 and the Hub items of class 7, against huggingface_hub's real client and the Hub
stand-in on loopback (``tests/support/hub_server.py``):

* fetch downloads exactly the files ``overlay.json`` lists (counted on the server), and a repo that
  ships an index or config.json its manifest does not list is refused;
* a ``--cache-dir`` inside the base snapshot is refused before anything is sent or written;
* whatever a hostile Hub answers to a commit, nothing token-like reaches ``overlay.published.json``
  or the output;
* repo ids are Hub ids by huggingface_hub's rules, and the card's front matter reads back
  (``yaml.safe_load``) as exactly the values flashnext wrote.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml
from click.testing import CliRunner

from flashnext.quant.overlays.hub import render_model_card
from flashnext.quant.overlays.manifest import OverlayManifest
from flashnext.tools.cli import main as cli
from support.hostile import INDEX, Case, Work, assert_refused, tree_state
from support.hub_server import HubServer, hub_on_loopback

TOKEN = "hf_flashnext_hostile_token_0123456789"
REPO = "flashnext-test/mtp-int4"
CONFIG = "config.json"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with hub_on_loopback(monkeypatch, tmp_path, TOKEN) as server:
        yield server


def overlay_repo_files(w: Work, edit_manifest: Callable[[dict], None] | None = None) -> dict[str, bytes]:
    """What an upload of ``w.ov`` leaves in a repo (its files, overlay.json, a card, .gitattributes),
    with the manifest edited by ``edit_manifest``; the overlay's files stay in the repo either way."""
    manifest = json.loads((w.ov / "overlay.json").read_text())
    files = {e["path"]: (w.ov / e["path"]).read_bytes() for e in manifest["replaces"] + manifest["adds"]}
    if edit_manifest:
        edit_manifest(manifest)
    files["overlay.json"] = json.dumps(manifest, indent=2).encode()
    files["README.md"] = b"---\ntags:\n- flashnext\n---\n# an overlay\n"
    files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    return files


def unlisting(name: str) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        m["replaces"] = [e for e in m["replaces"] if e["path"] != name]
        m["adds"] = [e for e in m["adds"] if e["path"] != name]
    return edit


def fetch(w: Work, hub: HubServer, cache: Path, *extra: str) -> list[str]:
    return ["overlay", "fetch", REPO, "--base", str(w.snap), "--out", str(w.root / "view"),
            "--endpoint", hub.endpoint, "--cache-dir", str(cache), *extra]


def errors_only(output: str) -> list[str]:
    """huggingface_hub's download bars may come first; the verdict is the ``Error:`` lines."""
    return [line for line in output.splitlines() if line.startswith("Error:")]


@dataclass(frozen=True)
class FetchCase:
    id: str
    setup: Callable[[Work, HubServer, Path], list[str]]
    message: str
    contacts_hub: bool = True


def published_then(edit: Callable[[dict], None] | None = None, cache: Callable[[Work, Path], Path] | None = None):
    def setup(w: Work, hub: HubServer, default_cache: Path) -> list[str]:
        hub.state.publish(REPO, overlay_repo_files(w, edit))
        return fetch(w, hub, cache(w, default_cache) if cache else default_cache)
    return setup


FETCH_REFUSALS = [
    FetchCase("repo-ships-unlisted-config", published_then(unlisting(CONFIG)),
              f"the repo {REPO} ships {CONFIG}, which overlay.json does not list"),
    FetchCase("repo-ships-unlisted-index", published_then(unlisting(INDEX)),
              f"the repo {REPO} ships {INDEX}, which overlay.json does not list"),
    FetchCase("cache-dir-inside-base", published_then(cache=lambda w, c: w.snap / "hf-cache"),
              "lies inside the base snapshot", contacts_hub=False),
    FetchCase("cache-dir-is-base", published_then(cache=lambda w, c: w.snap),
              "lies inside the base snapshot", contacts_hub=False),
]


@pytest.mark.parametrize("case", FETCH_REFUSALS, ids=[c.id for c in FETCH_REFUSALS])
def test_fetch_is_refused_in_one_line(case: FetchCase, work: Work, hub: HubServer, tmp_path: Path):
    argv = case.setup(work, hub, tmp_path / "cache")
    before = tree_state(work.root)
    result = CliRunner().invoke(cli, argv)
    errors = errors_only(result.output)
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert case.message in errors[0] and result.output.rstrip().endswith(errors[0]), result.output
    assert tree_state(work.root) == before, "fetch wrote or removed something (the base included)"
    if not case.contacts_hub:
        assert hub.state.log == [], "the refusal came after talking to the Hub"


def test_fetch_downloads_exactly_the_listed_files(work: Work, hub: HubServer, tmp_path: Path):
    files = overlay_repo_files(work)
    files["notes.bin"] = b"\x01" * 4096  # an LFS file nothing names
    files["extra.safetensors"] = b"\0" * 64
    hub.state.publish(REPO, files)
    listed = [e.path for e in OverlayManifest.load(work.ov).files]
    result = CliRunner().invoke(cli, fetch(work, hub, tmp_path / "cache", "--json"))
    assert result.exit_code == 0, result.output
    prefix = f"/{REPO}/resolve/"
    fetched = Counter(p.split("?")[0][len(prefix):].split("/", 1)[1] for m, p in hub.state.log
                      if m == "GET" and p.startswith(prefix))
    assert fetched == Counter(listed + ["overlay.json"]), fetched
    asked = {p.split("?")[0][len(prefix):].split("/", 1)[1] for m, p in hub.state.log if p.startswith(prefix)}
    assert asked == set(listed) | {"overlay.json"}, "a file nothing uses was asked for"
    local = Path(json.loads(result.stdout[result.stdout.index("{"):])["downloaded_to"])
    assert sorted(p.name for p in local.iterdir()) == sorted(listed + ["overlay.json"])
    assert CliRunner().invoke(cli, ["overlay", "verify", str(work.root / "view")]).exit_code == 0


@dataclass(frozen=True)
class EchoCase:
    id: str
    reply: dict[str, str]  # the commit answer's fields as the hostile Hub sends them
    exit_code: int
    message: str = ""


TOKEN_ECHOES = [
    EchoCase("token-in-commit-url", {"commitUrl": f"{{base}}/{REPO}/commit/{{commit}}?token={{token}}"}, 0),
    EchoCase("token-as-commit-id", {"commitOid": "{token}"}, 1, "names no valid commit id"),
    EchoCase("token-after-commit-id", {"commitOid": "{commit}{token}"}, 1, "names no valid commit id"),
    EchoCase("token-as-commit-url", {"commitUrl": "{token}"}, 1),
]


@pytest.mark.parametrize("case", TOKEN_ECHOES, ids=[c.id for c in TOKEN_ECHOES])
def test_a_hub_echoing_the_token_gets_nothing_stored(case: EchoCase, work: Work, hub: HubServer):
    hub.state.commit_reply_overrides = dict(case.reply)
    result = CliRunner().invoke(cli, ["overlay", "upload", str(work.ov), "--repo", REPO, "--endpoint", hub.endpoint,
                                      "--json"])
    assert TOKEN not in result.output
    assert result.exit_code == case.exit_code, result.output
    for path in work.ov.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
    published = work.ov / "overlay.published.json"
    if case.exit_code == 0:
        record = json.loads(published.read_text())
        assert set(record) == {"repo_id", "revision", "commit", "files"}
        assert record["commit"] == hub.state.repos[REPO].branches["main"] and record["repo_id"] == REPO
    else:
        errors = errors_only(result.output)
        assert len(errors) == 1 and case.message in errors[0], result.output
        assert not published.exists()


def set_base_repo_id(w: Work, repo_id: str) -> None:
    w.edit_json(w.ov / "overlay.json", lambda m: m["base"].update(repo_id=repo_id))


def dry_run(w: Work, repo: str = REPO) -> list[str]:
    return ["overlay", "upload", str(w.ov), "--repo", repo, "--dry-run"]


CARD_REFUSALS = [
    Case("base-repo-id-injects-a-key", lambda w: (set_base_repo_id(w, "org/x\nlicense: mit"), dry_run(w))[1],
         "not a Hugging Face repository id"),
    Case("base-repo-id-ends-the-front-matter",
         lambda w: (set_base_repo_id(w, "org/x\n---\n# hijacked"), dry_run(w))[1], "not a Hugging Face repository id"),
    Case("base-repo-id-with-a-colon", lambda w: (set_base_repo_id(w, "org/a: b"), dry_run(w))[1],
         "not a Hugging Face repository id"),
    Case("upload-repo-id-injects-a-key", lambda w: dry_run(w, "me/x\nlicense: mit"), "is not a valid repository id"),
    Case("upload-repo-id-with-a-space", lambda w: dry_run(w, "me/x y"), "is not a valid repository id"),
]


@pytest.mark.parametrize("case", CARD_REFUSALS, ids=[c.id for c in CARD_REFUSALS])
def test_a_repo_id_that_is_no_hub_id_is_refused(case: Case, work: Work):
    assert_refused(case, work)


# Valid Hub ids that plain YAML would read as something else: a bool, null, numbers, a date.
YAML_LOOKALIKES = ["true", "no", "null", "3.14", "0x1F", "12_345", "2024-01-01"]


@pytest.mark.parametrize("repo_id", YAML_LOOKALIKES)
def test_front_matter_reads_back_as_written(repo_id: str, work: Work):
    from huggingface_hub import ModelCard

    set_base_repo_id(work, repo_id)
    card = render_model_card(OverlayManifest.load(work.ov), REPO)
    assert card.startswith("---\n")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["base_model"] == repo_id and front["base_model_relation"] == "quantized"
    assert front["tags"][:3] == ["flashnext", "overlay", "mtp-int4"]
    assert ModelCard(card).data.to_dict()["base_model"] == repo_id  # huggingface_hub's own reading
