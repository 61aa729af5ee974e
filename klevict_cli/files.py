"""Atomic file writes: readers see the old file or the new one, never half of one.

Every file klevict writes (`.kvc` caches, bench JSON) goes through here: a temp file in the same directory, fsync,
rename over the target, then a best-effort sync of the directory. An interrupted write leaves no debris.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def write_atomically(path: Path, blob: bytes) -> None:
    """Write `blob` to `path` atomically; raises OSError (the caller words the error for its file kind)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _sync_directory(path.parent)


def _sync_directory(directory: Path) -> None:
    """Make the rename itself durable; best effort, as not every file system can sync a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
