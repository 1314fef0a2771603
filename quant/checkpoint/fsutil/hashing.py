"""Content hashes: what an overlay pins of the base it was built against, and of its own files."""

from __future__ import annotations

import hashlib
from pathlib import Path

from flashnext.quant.records.inputs import open_regular


HASH_CHUNK = 16 << 20


def sha256_file(path: Path, progress=None, what: str = "a file to hash") -> str:
    """Hex sha256 of a regular file's content (``what`` it is, for the refusal of anything else);
    ``progress(n)`` is called with each chunk's byte count."""
    digest = hashlib.sha256()
    with open_regular(path, what) as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
