"""A downloaded checkpoint snapshot: config.json, the safetensors index and its shards. Read-only."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from flashnext.errors import FlashnextError
from flashnext.quant.checkpoint.fsutil import confined
from flashnext.quant.records.inputs import FileIdentity, check_unchanged, open_regular
from flashnext.quant.records.jsonfile import get_dict, read_json_version
from flashnext.quant.formats.ct_config import QUANTIZATION_KEYS, quantization_config_of
from flashnext.quant.formats.safetensors_io import ShardHeader, TensorEntry, read_header

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class SnapshotOrigin:
    """Where a snapshot came from, when its path says so (the Hugging Face cache layout)."""

    repo_id: str | None = None
    revision: str | None = None


def read_config(path: Path) -> dict:
    """A model's config.json: a JSON object whose ``text_config`` and quantization config (at either
    level, see :func:`~flashnext.quant.formats.ct_config.quantization_holder`), where present, are
    objects too."""
    return _read_config(path)[0]


def read_config_version(path: Path) -> tuple[dict, FileIdentity]:
    """:func:`read_config`, and the version of the file it was read from: what
    :meth:`Snapshot.open` takes so that a config.json read once is not read again."""
    return _read_config(path)


def text_config_of(config: dict) -> dict:
    """The language model's config: ``text_config`` of a multimodal config, else the config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _read_config(path: Path) -> tuple[dict, FileIdentity]:
    config, version = read_json_version(path, "the model config")
    text = get_dict(config, "text_config", str(path), required=False)
    for where, obj in ((str(path), config), (f"{path}: text_config", text)):
        for key in QUANTIZATION_KEYS if obj is not None else ():
            get_dict(obj, key, where, required=False)
    return config, version


def read_index(path: Path) -> dict:
    """A safetensors index: ``weight_map`` maps tensor names to ``.safetensors`` files that stay
    inside the snapshot (a shard name is a path read from a file, so it is untrusted)."""
    return _read_index(path)[0]


def _read_index(path: Path) -> tuple[dict, FileIdentity]:
    index, version = read_json_version(path, "the safetensors index")
    weight_map = get_dict(index, "weight_map", str(path))
    if not weight_map:
        raise FlashnextError(f"{path}: weight_map is empty")
    get_dict(index, "metadata", str(path), required=False)
    checked: set[str] = set()
    for name, filename in weight_map.items():
        if filename in checked:
            continue
        where = f"{path}: weight_map[{name!r}]"
        if not isinstance(filename, str) or not filename.endswith(".safetensors"):
            raise FlashnextError(f"{where}: {filename!r} is not a .safetensors file name")
        confined(path.parent, filename, where)
        checked.add(filename)
    return index, version


@dataclass
class Snapshot:
    root: Path
    config: dict
    index: dict
    _headers: dict[str, ShardHeader] = field(default_factory=dict, repr=False)
    # The version of config.json and of the index that ``config`` and ``index`` were read from.
    _versions: dict[str, FileIdentity] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, root: Path, config: tuple[dict, FileIdentity] | None = None) -> "Snapshot":
        """Open a snapshot directory and check that every shard its index names is a file.
        ``config``: its config.json as :func:`read_config_version` already read it."""
        root = Path(root)
        if not root.is_dir():
            raise FlashnextError(f"{root}: not a directory")
        config, config_version = config if config is not None else _read_config(root / CONFIG_FILE)
        index, index_version = _read_index(root / INDEX_FILE)
        snap = cls(root, config, index, _versions={CONFIG_FILE: config_version, INDEX_FILE: index_version})
        missing = [f for f in snap.shard_files if not snap._is_shard_file(f)]
        if missing:
            raise FlashnextError(
                f"{root}: shard {missing[0]} named by {INDEX_FILE} is missing"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return snap

    def _is_shard_file(self, filename: str) -> bool:
        """False for a missing shard (or a directory of its name); one that is not a regular file (a
        FIFO, a device) is refused as what it is. Opened, not stat'ed: that is what reading it does."""
        try:
            open_regular(self.path(filename), "a safetensors shard").close()
        except (FileNotFoundError, IsADirectoryError):
            return False
        return True

    def check_unchanged(self) -> None:
        """Every file of the snapshot read so far (config.json, the index, each shard whose header
        was read) is still the version it was read from: a builder calls this just before renaming
        its output into place, so that a source rewritten after its last read makes no output. A
        rewrite in the same clock tick that keeps inode and size is not seen (see ``inputs.py``)."""
        for name, version in self._versions.items():
            check_unchanged(self.root / name, version)
        for header in self._headers.values():
            header.check_unchanged()

    @property
    def weight_map(self) -> dict[str, str]:
        return self.index["weight_map"]

    @property
    def text_config(self) -> dict:
        """The language model's config (:func:`text_config_of`)."""
        return text_config_of(self.config)

    @property
    def quantization_config(self) -> dict | None:
        """config.json's quantization config (:func:`~flashnext.quant.formats.ct_config.quantization_config_of`)."""
        return quantization_config_of(self.config)

    @cached_property
    def shard_files(self) -> list[str]:
        """Shard file names in index order (first appearance), without duplicates."""
        return list(dict.fromkeys(self.weight_map.values()))

    def path(self, filename: str) -> Path:
        return confined(self.root, filename, str(self.root / INDEX_FILE))

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
