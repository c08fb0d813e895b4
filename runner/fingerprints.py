"""What a resume must find unchanged besides the config: digests of the files a config names. Foundation: imports
nothing of runner, and no torch (a config's `fingerprint()` uses these)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path


def file_digest(path: Path) -> str:
    """The first 16 hex digits of the file's sha256."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def listing_digest(folder: Path, keep: Callable[[Path], bool]) -> tuple[int, str]:
    """(count, digest) of the kept files under `folder` by relative path, size and modification time: no contents
    read (folders can be large)."""
    lines, count = hashlib.sha256(), 0
    for file in sorted(p for p in folder.rglob("*") if keep(p) and p.is_file()):
        stat = file.stat()
        lines.update(f"{file.relative_to(folder)}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
        count += 1
    return count, lines.hexdigest()[:16]


def contents_digest(folder: Path, files: list[Path]) -> str:
    """The digest of small files' contents, by relative path."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(folder)}\t{file_digest(file)}\n".encode())
    return digest.hexdigest()[:16]
