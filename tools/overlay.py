"""``flashnext overlay``: verify overlays against a snapshot and apply them as a view."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from flashnext.errors import FlashnextError, VerificationMismatch
from flashnext.tools._common import emit_json, json_option, user_errors

LOGIN = "pass a token: `hf auth login`, or set HF_TOKEN"
# What to do about each reason a Hub request fails (flashnext.quant.overlays.hub.HubError.reason).
HUB_HINTS = {
    "invalid-id": "a repository id is NAMESPACE/NAME (check --repo)",
    "no-token": LOGIN,
    "unauthorized": "the token is wrong or expired: log in again with `hf auth login`, or set HF_TOKEN",
    "forbidden": "use a token with write access to the repository's namespace (`hf auth login`)",
    "repo-not-found": f"check the repository id; if it is private or gated, {LOGIN}",
    "gated": "ask for access on the repository's page, then log in with `hf auth login`",
    "revision-not-found": "check --revision (a branch, tag or commit of the repository)",
    "entry-not-found": "the repository changed while it was read: run the same command again",
    "offline": "unset HF_HUB_OFFLINE to reach the Hub",
    "unreachable": "check the network, and HF_ENDPOINT or --endpoint",
    "interrupted": "run the same command again (an upload does not send again what the Hub already has)",
    "server-error": "try again later",
    "refused": "",
}


def hub_hints(fn):
    """A Hub failure's one line, with what to do about it added."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from flashnext.quant.overlays.hub import HubError

        try:
            return fn(*args, **kwargs)
        except HubError as e:
            hint = HUB_HINTS[e.reason]
            raise FlashnextError(f"{e}; {hint}" if hint else str(e)) from None

    return wrapper


def card_serving():
    """What the serving system offers an overlay, for its model card: the library cannot ask serving
    itself (it never imports it), so the command hands it in."""
    from flashnext.quant.overlays.hub import CardServing, ServeTarget
    from flashnext.serving.compose import IMAGE
    from flashnext.serving.profiles import available, load_profile, speculative_method

    profiles = [load_profile(name) for name in available()]
    return CardServing(IMAGE, tuple(ServeTarget(p.name, p.model_family, speculative_method(p), p.uses_ple_table)
                                    for p in profiles))


@click.group("overlay")
def main() -> None:
    """Overlays: check them against a base snapshot, and apply them without copying."""


@main.command("verify")
@click.argument("target", type=click.Path(path_type=Path))
@click.option("--base", type=click.Path(path_type=Path), default=None,
              help="The base snapshot (not needed when TARGET is a view made by `overlay apply`).")
@click.option("--full", is_flag=True, help="Hash base files' whole content, not only their safetensors headers, "
                                           "and read the header of every other base shard (a view links them as they are).")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="With --full: show a progress bar of the bytes hashed on stderr.")
@json_option
@user_errors
def verify(target: Path, base: Path | None, full: bool, progress: bool, as_json: bool) -> None:
    """Check an OVERLAY against --base, or a VIEW: every overlay of it against its base, and every
    entry of it against what `overlay apply` made (missing, extra, a link replaced or redirected,
    an edited merged file).

    Overlay files are always checked by content hash; base files by their safetensors header hash
    (by content with --full, which also checks that every other shard of the base is a whole
    safetensors file). Each mismatch is one line; exit status 3 if there is any."""
    from flashnext.quant.overlays.view import read_view, verify_overlay, verify_view

    if not target.exists():
        raise FlashnextError(f"{target}: no such overlay or view")
    if base is None:
        if read_view(target) is None:
            raise FlashnextError(f"{target} is not a view: pass --base SNAPSHOT to verify an overlay")
        problems = verify_view(target, full, progress)
    else:
        problems = verify_overlay(base, target, full, progress)
    if as_json:
        emit_json({"ok": not problems, "mismatches": [{"path": p.path, "problem": p.problem} for p in problems]})
    else:
        for p in problems:
            click.echo(f"mismatch: {p}", err=True)
        if not problems:
            click.echo(f"ok: {target}")
    if problems:
        raise VerificationMismatch(f"{len(problems)} mismatch(es)")


@main.command("apply")
@click.argument("overlays", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--base", type=click.Path(path_type=Path), required=True, help="The base snapshot.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The view directory to create.")
@click.option("--force", is_flag=True, help="Replace an existing view.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check each overlay against the base first (header hashes).")
@json_option
@user_errors
def apply(overlays: tuple[Path, ...], base: Path, out: Path, force: bool, verify: bool, as_json: bool) -> None:
    """Make a view of --base with OVERLAYS applied in order: symlinks, nothing large copied.
    `vllm serve VIEW` loads it like a snapshot."""
    from flashnext.quant.overlays.view import apply_overlays

    result = apply_overlays(base, list(overlays), out, verify=verify, force=force)
    if as_json:
        emit_json(result)
    else:
        click.echo(f"wrote view {result['view']} ({len(overlays)} overlay(s) over {result['base']})")


@main.command("upload")
@click.argument("overlay", type=click.Path(path_type=Path))
@click.option("--repo", "repo_id", required=True, help="Hub repository id, e.g. you/Qwen3.8-Flash-Next-MTP-INT4.")
@click.option("--private", is_flag=True, help="Create the repository private.")
@click.option("--revision", default=None, help="Branch to commit to (created if needed; default main).")
@click.option("--dry-run", is_flag=True, help="List every file that would be uploaded, with sizes; contact nobody.")
@click.option("--endpoint", default=None, help="Hub endpoint (default: huggingface_hub's, i.e. HF_ENDPOINT).")
@json_option
@user_errors
@hub_hints
def upload(overlay: Path, repo_id: str, private: bool, revision: str | None, dry_run: bool,
           endpoint: str | None, as_json: bool) -> None:
    """Publish OVERLAY: its manifest's files, overlay.json and a generated model card, in one commit.
    The token comes from HF_TOKEN or `hf auth login` and is never printed."""
    from flashnext.quant.overlays.hub import upload_overlay

    result = upload_overlay(overlay, repo_id, private=private, revision=revision, dry_run=dry_run,
                            endpoint=endpoint, serving=card_serving())
    if as_json:
        emit_json(result)
        return
    for f in result["files"]:
        click.echo(f"{f['size']:>14,}  {f['path']}")
    if dry_run:
        click.echo(f"dry run: {len(result['files'])} files, {result['total_bytes']:,} bytes to {repo_id}; nothing sent")
    else:
        click.echo(f"published {repo_id}@{result['revision']}: commit {result['commit']}")


@main.command("fetch")
@click.argument("repo_id")
@click.option("--base", type=click.Path(path_type=Path), required=True, help="The base snapshot.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The view to create.")
@click.option("--revision", default=None, help="Branch, tag or commit of the overlay repo.")
@click.option("--endpoint", default=None, help="Hub endpoint (default: huggingface_hub's, i.e. HF_ENDPOINT).")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="huggingface_hub cache directory (not inside --base).")
@click.option("--force", is_flag=True, help="Replace an existing view.")
@json_option
@user_errors
@hub_hints
def fetch(repo_id: str, base: Path, out: Path, revision: str | None, endpoint: str | None,
          cache_dir: Path | None, force: bool, as_json: bool) -> None:
    """Download overlay REPO_ID (only the files its overlay.json lists), verify it against --base,
    and apply it as the view --out."""
    from flashnext.quant.overlays.hub import fetch_overlay

    result = fetch_overlay(repo_id, base, out, revision=revision, endpoint=endpoint, cache_dir=cache_dir,
                           force=force)
    if as_json:
        emit_json(result)
    else:
        click.echo(f"fetched {repo_id} and wrote view {result['view']}")
        click.echo(f"overlay files: {result['downloaded_to']} (serve's --overlay)")
