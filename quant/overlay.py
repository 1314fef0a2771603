"""The overlay manifest, ``overlay.json`` (schema: ``manifests/overlay.schema.json``).

An overlay is a directory of files that are mounted (or linked) over a base snapshot, file by
file, plus this manifest. The manifest pins the base files each overlay file replaces by sha256, so
that a mismatch between an overlay and the snapshot it is applied to can be detected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from flashnext import __version__
from flashnext.quant.fsutil import sha256_bytes, sha256_file, write_text_atomic
from flashnext.quant.safetensors_io import read_header
from flashnext.quant.snapshot import SnapshotOrigin

MANIFEST_FILE = "overlay.json"
SCHEMA_VERSION = 1


def header_sha256(path: Path) -> str | None:
    """sha256 of a safetensors file's length prefix and JSON header (names, dtypes, shapes and
    offsets): a cheap fingerprint of a multi-GB shard. None for other files."""
    if not str(path).endswith(".safetensors"):
        return None
    return sha256_bytes(read_header(path).header_bytes)


@dataclass
class OverlayManifest:
    kind: str
    builder: str
    base: SnapshotOrigin
    replaces: list[dict] = field(default_factory=list)
    adds: list[dict] = field(default_factory=list)
    report: dict = field(default_factory=dict)

    def replace(self, overlay_dir: Path, name: str, base_path: Path, base_sha256: str | None = None,
                progress=None) -> None:
        """Record that ``name`` in the overlay replaces the base file ``base_path``."""
        target = overlay_dir / name
        self.replaces.append({
            "path": name,
            "sha256": sha256_file(target, progress),
            "size": target.stat().st_size,
            "base_sha256": base_sha256 or sha256_file(base_path, progress),
            "base_size": base_path.stat().st_size,
            "base_header_sha256": header_sha256(base_path),
        })

    def to_json(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "builder": {"name": self.builder, "version": __version__},
            "base": {"repo_id": self.base.repo_id, "revision": self.base.revision},
            "replaces": self.replaces,
            "adds": self.adds,
            "report": self.report,
        }

    def write(self, overlay_dir: Path) -> Path:
        path = overlay_dir / MANIFEST_FILE
        write_text_atomic(path, json.dumps(self.to_json(), indent=2) + "\n")
        return path
