"""A downloaded checkpoint snapshot: config.json, the safetensors index and its shards. Read-only."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from flashnext.quant.errors import FlashnextError
from flashnext.quant.safetensors_io import ShardHeader, TensorEntry, read_header

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class SnapshotOrigin:
    """Where a snapshot came from, when its path says so (the Hugging Face cache layout)."""

    repo_id: str | None = None
    revision: str | None = None


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FlashnextError(f"{path.parent}: no {path.name} ({what}); is this a model snapshot?") from None
    except ValueError as e:
        raise FlashnextError(f"{path}: not valid JSON ({e})") from None


@dataclass
class Snapshot:
    root: Path
    config: dict
    index: dict
    _headers: dict[str, ShardHeader] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, root: Path) -> "Snapshot":
        """Open a snapshot directory and check that every shard its index names exists."""
        root = Path(root)
        if not root.is_dir():
            raise FlashnextError(f"{root}: not a directory")
        config = _read_json(root / CONFIG_FILE, "the model config")
        index = _read_json(root / INDEX_FILE, "the safetensors index")
        if not isinstance(index.get("weight_map"), dict) or not index["weight_map"]:
            raise FlashnextError(f"{root / INDEX_FILE}: has no weight_map")
        snap = cls(root, config, index)
        missing = [f for f in snap.shard_files if not (root / f).is_file()]
        if missing:
            raise FlashnextError(
                f"{root}: shard {missing[0]} named by {INDEX_FILE} is missing"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return snap

    @property
    def weight_map(self) -> dict[str, str]:
        return self.index["weight_map"]

    @property
    def text_config(self) -> dict:
        """The language model's config: ``text_config`` of a multimodal config, else the config."""
        return self.config.get("text_config", self.config)

    @property
    def quantization_config(self) -> dict | None:
        return self.config.get("quantization_config") or self.text_config.get("quantization_config")

    @cached_property
    def shard_files(self) -> list[str]:
        """Shard file names in index order (first appearance), without duplicates."""
        return list(dict.fromkeys(self.weight_map.values()))

    def path(self, filename: str) -> Path:
        return self.root / filename

    def header(self, filename: str) -> ShardHeader:
        if filename not in self._headers:
            self._headers[filename] = read_header(self.path(filename))
        return self._headers[filename]

    def entry(self, name: str) -> tuple[Path, TensorEntry]:
        """The file and header entry of tensor ``name``, checked against the index."""
        filename = self.weight_map.get(name)
        if filename is None:
            raise FlashnextError(f"{self.root}: tensor {name} is not in {INDEX_FILE}")
        header = self.header(filename)
        if name not in header.entries:
            raise FlashnextError(
                f"{self.path(filename)}: tensor {name} is missing although {INDEX_FILE} points here")
        return self.path(filename), header.entries[name]

    @property
    def origin(self) -> SnapshotOrigin:
        """Repo id and revision from a ``models--ORG--NAME/snapshots/REV`` path, else unknown."""
        resolved = self.root.absolute()
        if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
            repo = resolved.parent.parent.name[len("models--"):].replace("--", "/")
            return SnapshotOrigin(repo, resolved.name)
        return SnapshotOrigin()
