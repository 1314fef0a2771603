"""Publishing overlays to the Hugging Face Hub and fetching them back, with huggingface_hub.

Upload sends exactly the files the manifest names, ``overlay.json`` and a generated model card, in
one commit. Large files go through huggingface_hub's content-addressed upload (Xet, or LFS where
Xet is off): objects the server already holds are not sent again, so re-running an interrupted
upload only sends what is missing. The token comes from huggingface_hub's usual places
(``HF_TOKEN``, ``hf auth login``) and is never printed or stored by flashnext. The published commit
is recorded next to the manifest in ``overlay.published.json``.

Fetch downloads with ``snapshot_download``, verifies the files against the manifest and the base,
and applies the overlay as a view.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from flashnext import __version__
from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.fsutil import confined, write_text_atomic
from flashnext.quant.overlays.builder import builder_for_kind
from flashnext.quant.overlays.manifest import MANIFEST_FILE, OverlayManifest
from flashnext.quant.overlays.view import apply_overlays, overlay_file_problems, verify_overlay

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


def render_model_card(manifest: OverlayManifest, repo_id: str) -> str:
    """The README.md of an overlay repo: front matter, what changed, the report, how to use it."""
    base = manifest.base.model_dump()
    kind = manifest.kind
    tags = ["flashnext", "overlay", kind] + _TAGS.get(kind, [])
    front = ["---"]
    if base.get("repo_id"):
        front += [f"base_model: {base['repo_id']}", "base_model_relation: quantized"]
    front += ["tags:"] + [f"- {t}" for t in tags] + ["---", ""]
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
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _hub_error(e: Exception, action: str, repo_id: str) -> FlashnextError:
    """One line that says what went wrong with the Hub and what to do."""
    from huggingface_hub import errors

    if isinstance(e, errors.HFValidationError):
        return FlashnextError(f"{action} failed: {repo_id!r} is not a valid repository id ({_first_line(e)})")
    if isinstance(e, errors.RepositoryNotFoundError):
        return FlashnextError(f"{action} failed: {repo_id} does not exist or you cannot see it; if it is "
                              "private, log in with `hf auth login` or set HF_TOKEN")
    if isinstance(e, errors.GatedRepoError):
        return FlashnextError(f"{action} failed: {repo_id} is gated; ask for access on its page, then log in")
    if isinstance(e, errors.RevisionNotFoundError):
        return FlashnextError(f"{action} failed: {repo_id} has no such revision (--revision)")
    if isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        return FlashnextError(f"{action} failed: the Hub cannot be reached (offline, HF_HUB_OFFLINE, or a wrong "
                              "HF_ENDPOINT/--endpoint) and the overlay is not in the local cache")
    return FlashnextError(f"{action} failed: {_first_line(e)}")


def _hub_failures() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises for a bad id, a refused request or an unreachable server."""
    import httpx
    from huggingface_hub import errors

    return (errors.HfHubHTTPError, errors.HFValidationError, errors.LocalEntryNotFoundError,
            errors.OfflineModeIsEnabled, httpx.HTTPError, OSError, ValueError)


def upload_overlay(overlay: Path, repo_id: str, private: bool = False, revision: str | None = None,
                   dry_run: bool = False, endpoint: str | None = None) -> dict:
    """Publish ``overlay`` to ``repo_id`` (created if needed) in one commit. ``dry_run`` lists the
    files and sizes and contacts nobody."""
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
    published = {"repo_id": repo_id, "revision": revision or "main", "commit": info.oid,
                 "commit_url": info.commit_url,
                 "files": {f.path: f.sha256 for f in manifest.files}}
    write_text_atomic(overlay / PUBLISHED_FILE, json.dumps(published, indent=2) + "\n")
    return plan | {"commit": info.oid, "commit_url": info.commit_url, "published_record": str(overlay / PUBLISHED_FILE)}


def fetch_overlay(repo_id: str, base: Path, out: Path, revision: str | None = None, endpoint: str | None = None,
                  cache_dir: Path | None = None, force: bool = False) -> dict:
    """Download an overlay repo, verify it against ``base`` and apply it as the view ``out``."""
    from huggingface_hub import snapshot_download

    try:
        local = Path(snapshot_download(repo_id, revision=revision, endpoint=endpoint,
                                       cache_dir=str(cache_dir) if cache_dir else None))
    except _hub_failures() as e:
        raise _hub_error(e, f"download of {repo_id}", repo_id) from None
    problems = verify_overlay(base, local)
    if problems:
        raise FlashnextError(f"{repo_id} does not verify: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    result = apply_overlays(base, [local], out, verify=False, force=force)
    return result | {"repo_id": repo_id, "downloaded_to": str(local)}
