"""Publishing overlays to the Hugging Face Hub and fetching them back, with huggingface_hub.

Upload sends exactly the files the manifest names, ``overlay.json`` and a generated model card, in
one commit. Large files go through huggingface_hub's content-addressed upload (Xet, or LFS where
Xet is off): objects the server already holds are not sent again, so re-running an interrupted
upload only sends what is missing. The token comes from huggingface_hub's usual places
(``HF_TOKEN``, ``hf auth login``) and is never printed or stored by flashnext. The published commit
is recorded next to the manifest in ``overlay.published.json``: only what flashnext decided (the
repo id, the branch, the files) and the commit id once it is checked to be a commit hash, never
free text the server sent back (a hostile server may echo the token in it).

Fetch reads the repo's listing, downloads ``overlay.json``, then exactly the files it lists, all at
the one commit the listing named; a repo that ships an index or config.json its manifest does not
list is refused. It verifies the files against the manifest and the base, and applies the overlay
as a view.
"""

from __future__ import annotations

import importlib
import json
import tempfile
from pathlib import Path

from flashnext import __version__
from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.fsutil import confined, write_text_atomic
from flashnext.quant.overlays.builder import builder_for_kind
from flashnext.quant.overlays.manifest import MANIFEST_FILE, OverlayManifest, hub_repo_id_problem
from flashnext.quant.overlays.view import (
    apply_overlays,
    overlay_file_problems,
    refuse_unlisted_merged_files,
    verify_overlay,
)

PUBLISHED_FILE = "overlay.published.json"
CARD_FILE = "README.md"

_TAGS = {"mtp-int4": ["int4", "w4a16", "compressed-tensors", "mtp", "speculative-decoding"]}


def overlay_files(overlay: Path) -> list[tuple[str, Path]]:
    """(path in repo, local file) for every file an upload sends, except the generated card."""
    overlay = Path(overlay)
    manifest = OverlayManifest.load(overlay)
    names = [e.path for e in manifest.files] + [MANIFEST_FILE]
    files = []
    for name in names:
        local = confined(overlay, name, str(overlay / MANIFEST_FILE))
        if local.is_symlink():
            raise FlashnextError(f"{local} is a symlink; an overlay uploads real files only")
        if not local.is_file():
            raise FlashnextError(f"{local} is missing; the manifest names it")
        files.append((name, local))
    return files


def require_repo_id(repo_id: str, action: str) -> None:
    """Refuse what huggingface_hub would not accept as a repository id, before it reaches a card or
    a request (``action`` names what was refused, without the id, which is quoted escaped)."""
    problem = hub_repo_id_problem(repo_id)
    if problem:
        raise FlashnextError(f"{action}: {repo_id!r} is not a valid repository id ({problem})")


def card_front_matter(values: dict) -> str:
    """YAML front matter that reads back (``yaml.safe_load``) as exactly ``values``: every scalar
    double-quoted and escaped, on one line, so that no value can be read as a bool, a number or a
    key of its own, or end the front matter early."""
    import yaml

    return yaml.safe_dump(values, default_style='"', sort_keys=False, allow_unicode=True, width=2**30)


def render_model_card(manifest: OverlayManifest, repo_id: str) -> str:
    """The README.md of an overlay repo: front matter, what changed, the report, how to use it."""
    require_repo_id(repo_id, "not writing the model card")
    base = manifest.base.model_dump()
    kind = manifest.kind
    tags = ["flashnext", "overlay", kind] + _TAGS.get(kind, [])
    values: dict = {}
    if base.get("repo_id"):
        values |= {"base_model": base["repo_id"], "base_model_relation": "quantized"}
    values["tags"] = tags
    front = ["---", card_front_matter(values).rstrip("\n"), "---", ""]
    lines = front + [
        f"# {repo_id}", "",
        f"A flashnext **{kind}** overlay built by `{manifest.builder.name}` "
        f"(flashnext {manifest.builder.version}). It is not a full model: its files go over a "
        "snapshot of the base model, file by file; everything else is the base's.", "",
        "## Base", "",
        f"- repository: `{base.get('repo_id') or 'not recorded'}`",
        f"- revision: `{base.get('revision') or 'not recorded'}`", "",
        "## What changed", "",
        "| file | size | replaces base file (sha256) |", "|---|---|---|",
    ]
    for e in manifest.replaces:
        lines.append(f"| `{e.path}` | {e.size:,} B | `{e.base_sha256[:16]}…` ({e.base_size:,} B) |")
    for e in manifest.adds:
        lines.append(f"| `{e.path}` | {e.size:,} B | (new file) |")
    builder = builder_for_kind(kind)
    section = builder.card_section(manifest.report) if builder else []
    if section:
        lines += [""] + section
    lines += ["", "## Use", "", "```bash", "pip install flashnext",
              f"flashnext overlay fetch {repo_id} --base /path/to/base/snapshot --out ./view",
              "vllm serve ./view"
              + (" --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'"
                 if kind == "mtp-int4" else ""),
              "```", "",
              "`flashnext overlay verify ./view` checks later that the base and overlay files are still "
              "the ones this overlay was built from.", ""]
    return "\n".join(lines)


def _first_line(e: BaseException) -> str:
    """The error's first line, with the token masked: huggingface_hub's messages quote what the
    server answered, and a hostile server may answer with the token."""
    from huggingface_hub import get_token

    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    token = get_token()
    return line.replace(token, "<token>") if token else line


def _http_libraries() -> list:
    """The HTTP clients huggingface_hub raises from: httpx2 (2.x) or httpx (1.x)."""
    found = []
    for name in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            pass
    return found


def _hub_error(e: Exception, action: str, repo_id: str) -> FlashnextError:
    """One line that says what went wrong with the Hub and what to do."""
    from huggingface_hub import errors

    unreachable = tuple(c for lib in _http_libraries() for c in (lib.ConnectError, lib.TimeoutException))
    if isinstance(e, errors.HFValidationError):
        return FlashnextError(f"{action} failed: {repo_id!r} is not a valid repository id ({_first_line(e)})")
    if isinstance(e, errors.RepositoryNotFoundError):
        return FlashnextError(f"{action} failed: {repo_id} does not exist or you cannot see it; if it is "
                              "private, log in with `hf auth login` or set HF_TOKEN")
    if isinstance(e, errors.GatedRepoError):
        return FlashnextError(f"{action} failed: {repo_id} is gated; ask for access on its page, then log in")
    if isinstance(e, errors.RevisionNotFoundError):
        return FlashnextError(f"{action} failed: {repo_id} has no such revision (--revision)")
    if isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, *unreachable)):
        return FlashnextError(f"{action} failed: the Hub cannot be reached (offline, HF_HUB_OFFLINE, or a wrong "
                              "HF_ENDPOINT/--endpoint)")
    return FlashnextError(f"{action} failed: {_first_line(e)}")


def _hub_failures() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises for a bad id, a refused request or an unreachable server."""
    from huggingface_hub import errors

    return (errors.HfHubHTTPError, errors.HFValidationError, errors.LocalEntryNotFoundError,
            errors.OfflineModeIsEnabled, *(lib.HTTPError for lib in _http_libraries()), OSError, ValueError)


def _commit_hash(value: object) -> str | None:
    """``value`` if it is a commit hash by huggingface_hub's own rule, else None."""
    from huggingface_hub.file_download import REGEX_COMMIT_HASH

    return value if isinstance(value, str) and REGEX_COMMIT_HASH.fullmatch(value) else None


def upload_overlay(overlay: Path, repo_id: str, private: bool = False, revision: str | None = None,
                   dry_run: bool = False, endpoint: str | None = None) -> dict:
    """Publish ``overlay`` to ``repo_id`` (created if needed) in one commit. ``dry_run`` lists the
    files and sizes and contacts nobody."""
    require_repo_id(repo_id, "not uploading")
    overlay = Path(overlay)
    manifest = OverlayManifest.load(overlay)
    files = overlay_files(overlay)
    card = render_model_card(manifest, repo_id)
    listing = [{"path": name, "size": local.stat().st_size} for name, local in files]
    listing.append({"path": CARD_FILE, "size": len(card.encode()), "generated": True})
    plan = {"repo_id": repo_id, "revision": revision or "main", "private": private, "files": listing,
            "total_bytes": sum(f["size"] for f in listing)}
    if dry_run:
        return plan | {"dry_run": True}
    # The overlay's own files must be the ones its manifest describes before they are published.
    corrupt = overlay_file_problems(overlay, manifest)
    if corrupt:
        raise FlashnextError(f"not uploading: {corrupt[0]}")

    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(endpoint=endpoint, library_name="flashnext", library_version=__version__)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            card_path = Path(tmp) / CARD_FILE
            card_path.write_text(card)
            operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(local))
                          for name, local in files]
            operations.append(CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=str(card_path)))
            info = api.create_commit(repo_id, operations=operations, revision=revision,
                                     commit_message=f"flashnext {manifest.kind} overlay "
                                                    f"({manifest.builder.name} {manifest.builder.version})")
    except (*_hub_failures(), RuntimeError) as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if (status is not None and 400 <= status < 500) or isinstance(e, ValueError):
            raise _hub_error(e, f"upload to {repo_id}", repo_id) from None
        raise FlashnextError(f"upload to {repo_id} was interrupted ({_first_line(e.__cause__ or e)}); "
                             "run the same command again: files already on the Hub are not sent twice") from None
    # The server's answer is untrusted text: of it, only a well-formed commit id is kept.
    commit = _commit_hash(info.oid)
    if commit is None:
        raise FlashnextError(f"upload to {repo_id}: the Hub's answer names no valid commit id, so nothing is "
                             f"recorded in {PUBLISHED_FILE}; check the repository's history on the Hub")
    published = {"repo_id": repo_id, "revision": revision or "main", "commit": commit,
                 "files": {f.path: f.sha256 for f in manifest.files}}
    write_text_atomic(overlay / PUBLISHED_FILE, json.dumps(published, indent=2) + "\n")
    return plan | {"commit": commit, "published_record": str(overlay / PUBLISHED_FILE)}


def refuse_cache_inside_base(cache: Path, base: Path) -> None:
    """The download cache is written; the base snapshot never is."""
    c, b = Path(cache).resolve(), Path(base).resolve()
    if c == b or b in c.parents:
        raise FlashnextError(f"the download cache {cache} lies inside the base snapshot {base}, which flashnext "
                             "never writes into; pass --cache-dir outside it")


def fetch_overlay(repo_id: str, base: Path, out: Path, revision: str | None = None, endpoint: str | None = None,
                  cache_dir: Path | None = None, force: bool = False) -> dict:
    """Download the files overlay repo ``repo_id``'s manifest lists (and only those), verify them
    against ``base`` and apply them as the view ``out``."""
    from huggingface_hub import HfApi, constants, hf_hub_download

    require_repo_id(repo_id, "not fetching")
    action = f"download of {repo_id}"
    base = Path(base)
    if not base.is_dir():
        raise FlashnextError(f"{base}: the base snapshot is not a directory")
    refuse_cache_inside_base(Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE), base)

    def download(name: str, commit: str) -> Path:
        return Path(hf_hub_download(repo_id, name, revision=commit, endpoint=endpoint,
                                    cache_dir=str(cache_dir) if cache_dir else None,
                                    library_name="flashnext", library_version=__version__))

    api = HfApi(endpoint=endpoint, library_name="flashnext", library_version=__version__)
    try:
        info = api.model_info(repo_id, revision=revision)
        # Every file comes from this one commit, and its id names a folder of the cache: a hash only.
        commit = _commit_hash(info.sha)
        if commit is None:
            raise FlashnextError(f"{action} failed: the Hub's answer names no valid commit id")
        in_repo = {sibling.rfilename for sibling in info.siblings or []}
        if MANIFEST_FILE not in in_repo:
            raise FlashnextError(f"{repo_id} has no {MANIFEST_FILE}; is it a flashnext overlay?")
        local = download(MANIFEST_FILE, commit).parent
    except _hub_failures() as e:
        raise _hub_error(e, action, repo_id) from None
    manifest = OverlayManifest.load(local)
    refuse_unlisted_merged_files(manifest, in_repo, f"the repo {repo_id}")
    listed = [entry.path for entry in manifest.files]
    absent = [name for name in listed if name not in in_repo]
    if absent:
        raise FlashnextError(f"{repo_id}: its {MANIFEST_FILE} lists {absent[0]}, which the repo does not have")
    try:
        for name in listed:
            download(name, commit)
    except _hub_failures() as e:
        raise _hub_error(e, action, repo_id) from None
    problems = verify_overlay(base, local)
    if problems:
        raise FlashnextError(f"{repo_id} does not verify: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    result = apply_overlays(base, [local], out, verify=False, force=force)
    return result | {"repo_id": repo_id, "commit": commit, "downloaded_to": str(local)}
