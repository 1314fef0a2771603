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

A failed request is a :class:`HubError`: what was being done, the repository, the reason, the HTTP
status; the command line adds what to do. huggingface_hub's own error classes are mapped, and its
HTTP client's (httpx2, httpx or requests, by version) only through the base class huggingface_hub
gives them, since no HTTP client is a dependency of flashnext's own.

The model card's Use section says how to serve the overlay, which only the serving system knows
(its profiles, its image). The library does not import serving, so those facts come in from the
caller as a :class:`CardServing` record (``flashnext overlay upload`` builds it from
``flashnext.serving``); what is the overlay kind's own (its tags, the speculative method that loads
a draft head) is what its builder declares, found through
:data:`~flashnext.quant.overlays.builder.OVERLAY_KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from flashnext import __version__
from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.fsutil import confined, scratch_directory, write_text_atomic
from flashnext.quant.overlays.builder import OVERLAY_KINDS, builder_for_kind
from flashnext.quant.overlays.manifest import MANIFEST_FILE, OverlayManifest, hub_repo_id_problem
from flashnext.quant.overlays.view import (
    apply_overlays,
    overlay_file_problems,
    refuse_unlisted_merged_files,
    verify_overlay,
)
from flashnext.quant.records.strict import Sha256, StrictRecord

PUBLISHED_FILE = "overlay.published.json"


class PublishedRecord(StrictRecord):
    """``overlay.published.json``: where ``overlay upload`` published the overlay, and which files
    (by sha256) that commit holds. Only what flashnext decided; nothing the server said but the
    commit id, checked to be one."""

    repo_id: str
    revision: str
    commit: str = Field(pattern=r"^[0-9a-f]{40}$")
    files: dict[str, Sha256]
CARD_FILE = "README.md"


@dataclass(frozen=True)
class ServeTarget:
    """A serving profile, as much of it as the model card's Use section says."""

    name: str
    model_family: str  # the vLLM model family it serves
    speculative_method: str | None  # its --speculative-config method ("mtp"), None where it has none
    uses_ple_table: bool  # it maps a PLE table file, which `flashnext ple build` makes


@dataclass(frozen=True)
class CardServing:
    """What the serving system offers an overlay: the image ``flashnext serve`` builds and its profiles."""

    image: str
    profiles: tuple[ServeTarget, ...]


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


def render_model_card(manifest: OverlayManifest, repo_id: str, serving: CardServing | None = None) -> str:
    """The README.md of an overlay repo: front matter, what changed, the report, how to use it
    (how to serve it only where ``serving`` says what serves it)."""
    require_repo_id(repo_id, "not writing the model card")
    base = manifest.base.model_dump()
    kind = manifest.kind
    entry = OVERLAY_KINDS.get(kind)
    tags = ["flashnext", "overlay", kind] + list(entry.card_tags if entry else ())
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
    lines += ["", "## Use", ""] + _use_section(kind, repo_id, serving) + [""]
    return "\n".join(lines)


# Placeholders of the card's commands: the reader's own paths.
BASE_PLACEHOLDER = "/path/to/base/snapshot"
OVERLAY_PLACEHOLDER = "/path/to/overlay"
PLE_TABLE_PLACEHOLDER = "/path/to/ple-table.bin"


def serving_profiles_for(kind: str, serving: CardServing) -> list[ServeTarget]:
    """The profiles of ``serving`` an overlay of ``kind`` is for: those that serve the base model's
    vLLM family (``manifests/qwen3.8-flash-next.json``); a draft head's overlay (its kind's
    ``draft_method``) only where the profile speculates with that head."""
    from flashnext.manifests import manifest_path
    from flashnext.quant.records.jsonfile import read_json

    family = read_json(manifest_path("qwen3.8-flash-next.json"), "the base model manifest")["vllm_model_family"]
    entry = OVERLAY_KINDS.get(kind)
    method = entry.draft_method if entry else None
    return [p for p in serving.profiles if p.model_family == family
            and (method is None or p.speculative_method == method)]


def repository_url() -> str | None:
    """flashnext's repository, as pyproject.toml's ``[project.urls]`` names it (read from the
    installed metadata), or None where it names none."""
    from importlib import metadata

    try:
        urls = metadata.metadata("flashnext").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return None
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("repository", "source", "source code", "homepage") and url.strip():
            return url.strip()
    return None


def _use_section(kind: str, repo_id: str, serving: CardServing | None) -> list[str]:
    """How to get flashnext, fetch the overlay and serve it: commands of flashnext's own CLI that a
    reader can run as written after putting in their paths (tests/quant/overlays/test_hub.py parses
    each with the CLI). Without ``serving``, how to fetch and check it only."""
    url = repository_url()
    where = f"its repository, {url}" if url else "a clone of its repository"
    if serving is None:
        lines = [f"flashnext is not on PyPI: install it from {where}, editable.", "", "```bash"]
    else:
        lines = [f"flashnext is not on PyPI: install it from {where}, editable, so that `flashnext serve` can "
                 f"build its serving image `{serving.image}` (the vLLM release its tag names, with flashnext's "
                 "patch series, `serving/Dockerfile`) from the clone on first use.", "", "```bash"]
    if url:
        lines.append(f"git clone {url} flashnext")
    lines += ["pip install -e ./flashnext",
              f"flashnext overlay fetch {repo_id} --base {BASE_PLACEHOLDER} --out ./view"]
    profiles = serving_profiles_for(kind, serving) if serving is not None else []
    if profiles:
        profile = profiles[0]
        serve = f"flashnext serve --profile {profile.name} --model {BASE_PLACEHOLDER} --overlay {OVERLAY_PLACEHOLDER}"
        if profile.uses_ple_table:
            lines.append(f"flashnext ple build --src {BASE_PLACEHOLDER} --out {PLE_TABLE_PLACEHOLDER}")
            serve += f" --ple-table {PLE_TABLE_PLACEHOLDER}"
        lines.append(serve)
    lines += ["```", "",
              "`overlay fetch` downloads exactly the files this overlay's `overlay.json` lists, checks them and "
              "your snapshot of the base by hash, makes `./view` (a view of symlinks) and prints the folder "
              f"the overlay's files are in: that folder is `serve`'s `--overlay` ({OVERLAY_PLACEHOLDER} above)."]
    if profiles:
        names = ", ".join(f"`{p.name}`" for p in profiles)
        lines += ["", f"This overlay is for the serving profile{'s' if len(profiles) > 1 else ''} {names} "
                  f"(`flashnext plan --profile {profiles[0].name}` shows what it fits in memory). `serve` runs the "
                  "go/no-go preflight first (GPUs, host memory, the overlay against the base) and starts nothing "
                  "on a NO-GO."]
        if profiles[0].uses_ple_table:
            lines += ["", f"`{profiles[0].name}` maps the PLE table from a file: `flashnext ple build` makes it "
                      "once from the base snapshot."]
    elif serving is not None:
        lines += ["", f"No serving profile of flashnext {__version__} loads a {kind} overlay; "
                  "`flashnext overlay apply` makes a view of it over the base for your own server."]
    lines += ["", "`flashnext overlay verify ./view` checks later that the base and overlay files are still "
              "the ones this overlay was built from."]
    return lines


def _first_line(e: BaseException) -> str:
    """The error's first line, with the token masked: huggingface_hub's messages quote what the
    server answered, and a hostile server may answer with the token."""
    from huggingface_hub import get_token

    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    token = get_token()
    return line.replace(token, "<token>") if token else line


# Why a Hub request failed, as HubError.reason: the command line turns each into what to do.
HUB_FAILURE_REASONS = ("invalid-id", "no-token", "unauthorized", "forbidden", "repo-not-found", "gated",
                       "revision-not-found", "entry-not-found", "offline", "unreachable", "interrupted", "server-error",
                       "refused")


class HubError(FlashnextError):
    """A Hub request that failed, as data: what flashnext was doing (``action``), the repository,
    why (one of :data:`HUB_FAILURE_REASONS`), the HTTP status the Hub answered (None when no answer
    came), the endpoint asked and the failure's own first line (token masked). The message says
    what happened; what to do about it is the command line's to add."""

    def __init__(self, action: str, repo_id: str, reason: str, endpoint: str, status: int | None = None,
                 detail: str = ""):
        assert reason in HUB_FAILURE_REASONS, reason
        self.action, self.repo_id, self.reason, self.endpoint = action, repo_id, reason, endpoint
        self.status, self.detail = status, detail
        super().__init__(f"{action} failed: {self._what()}")

    def _what(self) -> str:
        http = f"HTTP {self.status}" if self.status is not None else "no HTTP status"
        return {
            "invalid-id": f"{self.repo_id!r} is not a valid repository id ({self.detail})",
            "no-token": f"the Hub at {self.endpoint} wants a token, and none is set ({http})",
            "unauthorized": f"the Hub at {self.endpoint} refused the token ({http})",
            "forbidden": f"the token may not do this to {self.repo_id} ({http})",
            "repo-not-found": f"{self.repo_id} does not exist at {self.endpoint}, or this token cannot see it ({http})",
            "gated": f"{self.repo_id} is gated ({http})",
            "revision-not-found": f"{self.repo_id} has no such revision ({http})",
            "entry-not-found": f"a file of {self.repo_id} is not on the Hub ({http}: {self.detail})",
            "offline": "huggingface_hub is in offline mode (HF_HUB_OFFLINE is set)",
            "unreachable": f"the Hub at {self.endpoint} cannot be reached ({self.detail})",
            "interrupted": f"it was interrupted ({self.detail})",
            "server-error": f"the Hub at {self.endpoint} answered {http} ({self.detail})",
            "refused": f"the Hub refused the request ({http}: {self.detail})" if self.status is not None
                       else self.detail,
        }[self.reason]


def _transport_root() -> type[BaseException]:
    """The root exception of the HTTP client huggingface_hub runs on (httpx2's ``HTTPError`` in 2.x,
    httpx's in 1.x, requests' ``RequestException`` in 0.x), found as the outermost base of
    ``HfHubHTTPError`` that is neither huggingface_hub's nor Python's: none of those clients is a
    dependency of flashnext's own, so none is imported by name."""
    from huggingface_hub import errors

    foreign = [c for c in errors.HfHubHTTPError.__mro__
               if c.__module__.partition(".")[0] not in ("huggingface_hub", "builtins")]
    return foreign[-1] if foreign else OSError


def _hub_failures() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises for a bad id, a refused request or an unreachable server."""
    from huggingface_hub import errors

    return (errors.HfHubHTTPError, errors.HFValidationError, errors.LocalEntryNotFoundError,
            errors.OfflineModeIsEnabled, _transport_root(), OSError, ValueError)


def _hub_error(e: BaseException, action: str, repo_id: str, endpoint: str | None, reached: bool) -> Exception:
    """``e`` as a :class:`HubError`. ``reached``: an earlier request of this command got an answer,
    so a request that now gets none was cut off (interrupted) rather than never connected
    (unreachable). An error of the local machine (a full disk in the cache) stays an OSError."""
    from huggingface_hub import constants, errors, get_token

    # huggingface_hub wraps a failed LFS transfer in a RuntimeError whose cause is the failure.
    while isinstance(e, RuntimeError) and e.__cause__ is not None:
        e = e.__cause__
    where = endpoint or constants.ENDPOINT
    status = getattr(getattr(e, "response", None), "status_code", None)

    def fail(reason: str, detail: str = "") -> HubError:
        return HubError(action, repo_id, reason, where, status, detail)

    if isinstance(e, errors.HFValidationError):
        return fail("invalid-id", _first_line(e))
    if isinstance(e, errors.OfflineModeIsEnabled):
        return fail("offline")
    if isinstance(e, errors.GatedRepoError):
        return fail("gated")
    if isinstance(e, errors.RepositoryNotFoundError):
        return fail("repo-not-found")
    if isinstance(e, errors.RevisionNotFoundError):
        return fail("revision-not-found")
    if isinstance(e, errors.EntryNotFoundError) and status is not None:
        return fail("entry-not-found", _first_line(e))
    if status is not None:
        if status == 401:
            return fail("unauthorized" if get_token() else "no-token")
        if status == 403:
            return fail("forbidden")
        if status >= 500:
            return fail("interrupted" if reached else "server-error", _first_line(e))
        return fail("refused", _first_line(e))
    # No answer: huggingface_hub's not-in-cache error carries the transport's as its cause.
    no_answer = e.__cause__ if isinstance(e, errors.LocalEntryNotFoundError) and e.__cause__ else e
    if isinstance(no_answer, _transport_root()) or isinstance(no_answer, (ConnectionError, TimeoutError)):
        detail = f"{type(no_answer).__name__}: {_first_line(no_answer)}"
        return fail("interrupted" if reached else "unreachable", detail)
    if isinstance(e, errors.LocalEntryNotFoundError):
        return fail("unreachable", _first_line(e))
    if isinstance(e, OSError):
        return e  # the local machine's: user_errors prints it as one line
    return fail("refused", _first_line(e))


def _commit_hash(value: object) -> str | None:
    """``value`` if it is a commit hash by huggingface_hub's own rule, else None."""
    from huggingface_hub.file_download import REGEX_COMMIT_HASH

    return value if isinstance(value, str) and REGEX_COMMIT_HASH.fullmatch(value) else None


def upload_overlay(overlay: Path, repo_id: str, private: bool = False, revision: str | None = None,
                   dry_run: bool = False, endpoint: str | None = None, serving: CardServing | None = None) -> dict:
    """Publish ``overlay`` to ``repo_id`` (created if needed) in one commit. ``dry_run`` lists the
    files and sizes and contacts nobody. ``serving`` is what the model card says serves it."""
    require_repo_id(repo_id, "not uploading")
    overlay = Path(overlay)
    manifest = OverlayManifest.load(overlay)
    files = overlay_files(overlay)
    card = render_model_card(manifest, repo_id, serving)
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
    reached = False
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        reached = True
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        with scratch_directory("upload", "flashnext overlay upload") as tmp:
            card_path = tmp / CARD_FILE
            card_path.write_text(card)
            operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(local))
                          for name, local in files]
            operations.append(CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=str(card_path)))
            info = api.create_commit(repo_id, operations=operations, revision=revision,
                                     commit_message=f"flashnext {manifest.kind} overlay "
                                                    f"({manifest.builder.name} {manifest.builder.version})")
    except (*_hub_failures(), RuntimeError) as e:
        raise _hub_error(e, f"upload to {repo_id}", repo_id, endpoint, reached) from None
    # The server's answer is untrusted text: of it, only a well-formed commit id is kept.
    commit = _commit_hash(info.oid)
    if commit is None:
        raise FlashnextError(f"upload to {repo_id}: the Hub's answer names no valid commit id, so nothing is "
                             f"recorded in {PUBLISHED_FILE}; check the repository's history on the Hub")
    published = PublishedRecord(repo_id=repo_id, revision=revision or "main", commit=commit,
                                files={f.path: f.sha256 for f in manifest.files})
    write_text_atomic(overlay / PUBLISHED_FILE, published.model_dump_json(indent=2) + "\n")
    return plan | {"commit": commit, "published_record": str(overlay / PUBLISHED_FILE)}


def refuse_cache_inside_base(cache: Path, base: Path) -> None:
    """The download cache is written; the base snapshot never is."""
    c, b = Path(cache).resolve(), Path(base).resolve()
    if c == b or b in c.parents:
        raise FlashnextError(f"{cache} (the download cache) lies inside the base snapshot {base}, which flashnext "
                             "never writes into; choose a cache outside it", field="cache_dir")


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
    reached = False
    try:
        info = api.model_info(repo_id, revision=revision)
        reached = True
        # Every file comes from this one commit, and its id names a folder of the cache: a hash only.
        commit = _commit_hash(info.sha)
        if commit is None:
            raise FlashnextError(f"{action} failed: the Hub's answer names no valid commit id")
        in_repo = {sibling.rfilename for sibling in info.siblings or []}
        if MANIFEST_FILE not in in_repo:
            raise FlashnextError(f"{repo_id} has no {MANIFEST_FILE}; is it a flashnext overlay?")
        local = download(MANIFEST_FILE, commit).parent
    except _hub_failures() as e:
        raise _hub_error(e, action, repo_id, endpoint, reached) from None
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
        raise _hub_error(e, action, repo_id, endpoint, reached) from None
    problems = verify_overlay(base, local)
    if problems:
        raise FlashnextError(f"{repo_id} does not verify: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    result = apply_overlays(base, [local], out, verify=False, force=force)
    return result | {"repo_id": repo_id, "commit": commit, "downloaded_to": str(local)}
