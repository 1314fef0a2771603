"""The overlay manifest, ``overlay.json`` (schema: ``manifests/overlay.schema.json``, generated from
:class:`OverlayManifest` and tested equal to it, so the two cannot drift).

An overlay is a directory of files that are mounted (or linked) over a base snapshot, file by
file, plus this manifest. The manifest pins the base files each overlay file replaces by sha256, so
that a mismatch between an overlay and the snapshot it is applied to can be detected.

:class:`OverlayManifest` is both what a builder fills in and what every reader gets back from
:meth:`OverlayManifest.load`: a typed object that rejects unknown keys, wrong types and file paths
that would leave the overlay directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator

from flashnext import __version__
from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.fsutil import OUTPUT_MARKER, confined, sha256_file, write_text_atomic
from flashnext.quant.records.jsonfile import read_model
from flashnext.quant.records.strict import BuilderInfo, Count, Sha256, StrictRecord
from flashnext.quant.formats.safetensors_io import header_sha256
from flashnext.quant.checkpoint.snapshot import SnapshotOrigin

MANIFEST_FILE = "overlay.json"
SCHEMA_VERSION = 1
# Files of flashnext's own bookkeeping that no manifest entry may name.
RESERVED_NAMES = frozenset({MANIFEST_FILE, OUTPUT_MARKER, ".flashnext-view.json", "overlay.published.json"})

def hub_repo_id_problem(repo_id: str) -> str | None:
    """Why ``repo_id`` is not a Hugging Face repository id by huggingface_hub's own rules, or None."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        # huggingface_hub quotes the id as given: its line breaks must not break the message's one line.
        return str(e).strip().replace("\r", "\\r").replace("\n", "\\n")
    return None


class BaseInfo(StrictRecord):
    """The base snapshot, when known from its Hugging Face cache path."""

    repo_id: str | None
    revision: str | None

    # The repo id goes into the model card's front matter and commands: only a real Hub id may.
    @field_validator("repo_id")
    @classmethod
    def _hub_repo_id(cls, repo_id: str | None) -> str | None:
        if repo_id is not None and (problem := hub_repo_id_problem(repo_id)):
            raise ValueError(f"not a Hugging Face repository id ({problem})")
        return repo_id


class ReplacedFile(StrictRecord):
    """An overlay file that replaces the base file of the same path (a shard, the index, config.json)."""

    path: str
    sha256: Sha256
    size: Count
    base_sha256: Sha256
    base_size: Count
    base_header_sha256: Sha256 | None = Field(
        description="For a .safetensors base file: sha256 of its 8-byte length prefix and JSON header, what "
                    "`overlay verify` checks without --full.")


class AddedFile(StrictRecord):
    """An overlay file with no counterpart in the base."""

    path: str
    sha256: Sha256
    size: Count


class OverlayManifest(StrictRecord):
    """An overlay is a directory of files mounted (or linked) over a base snapshot file by file, plus
    this manifest. Every overlay file either replaces a base file of the same relative path (pinned
    by the base file's sha256) or adds a new one."""

    schema_version: Literal[1] = SCHEMA_VERSION
    kind: Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9-]*$")] = Field(
        description="What the overlay does, e.g. mtp-int4.")
    builder: BuilderInfo
    base: BaseInfo
    replaces: list[ReplacedFile] = Field(default_factory=list)
    adds: list[AddedFile] = Field(default_factory=list)
    report: dict = Field(default_factory=dict, description="The builder's report (for mtp-int4: "
                                                           "per-projection quantization error).")

    @classmethod
    def new(cls, kind: str, builder: str, base: SnapshotOrigin) -> "OverlayManifest":
        # A cache folder name that does not spell a Hub repo id says nothing about the base's origin.
        repo_id = base.repo_id if base.repo_id is not None and hub_repo_id_problem(base.repo_id) is None else None
        return cls(kind=kind, builder=BuilderInfo(name=builder, version=__version__),
                   base=BaseInfo(repo_id=repo_id, revision=base.revision))

    @classmethod
    def load(cls, overlay: Path) -> "OverlayManifest":
        """Read and check ``OVERLAY/overlay.json``; every path it names must stay inside OVERLAY."""
        overlay = Path(overlay)
        path = overlay / MANIFEST_FILE
        if not path.exists():  # a FIFO or a device exists: read_model refuses it as what it is
            raise FlashnextError(f"{overlay}: no {MANIFEST_FILE}; is this a flashnext overlay?")
        manifest = read_model(path, cls, "an overlay manifest")
        seen: set[str] = set()
        for entry in manifest.files:
            confined(overlay, entry.path, str(path))
            if entry.path in RESERVED_NAMES:
                raise FlashnextError(f"{path}: {entry.path} is flashnext's own file, not an overlay file")
            if entry.path in seen:
                raise FlashnextError(f"{path}: {entry.path} is listed twice")
            seen.add(entry.path)
        return manifest

    @property
    def files(self) -> list[ReplacedFile | AddedFile]:
        return [*self.replaces, *self.adds]

    def replace(self, overlay_dir: Path, name: str, base_path: Path, base_sha256: str | None = None,
                progress=None) -> None:
        """Record that ``name`` in the overlay replaces the base file ``base_path``."""
        target = confined(overlay_dir, name, "overlay")
        self.replaces.append(ReplacedFile(
            path=name, sha256=sha256_file(target, progress), size=target.stat().st_size,
            base_sha256=base_sha256 or sha256_file(base_path, progress), base_size=base_path.stat().st_size,
            base_header_sha256=header_sha256(base_path)))

    def to_json(self) -> dict:
        return self.model_dump(mode="json")

    def write(self, overlay_dir: Path) -> Path:
        path = overlay_dir / MANIFEST_FILE
        write_text_atomic(path, json.dumps(self.to_json(), indent=2) + "\n")
        return path
