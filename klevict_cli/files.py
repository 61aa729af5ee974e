"""Atomic file writes: readers see the old file or the new one, never half of one.

Every file klevict writes (`.kvc` caches, bench JSON) goes through here (and `-o -` through `write_stdout`): a temp file in the same directory, fsync,
rename over the target, then a best-effort sync of the directory. An interrupted write leaves no debris. Only a
regular file is ever replaced: a rename over `/dev/null`, a FIFO or a socket would destroy it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import sys
from pathlib import Path

from klevict_cli.errors import OutputError, UsageError

# Output names that mean standard output; renaming a temp file over /dev/stdout would replace the device instead.
STDOUT_NAMES = ("-", "/dev/stdout")
STDOUT_NAME = "<stdout>"  # how messages name it


def is_stdout(path: Path | str) -> bool:
    return str(path) in STDOUT_NAMES


def write_stdout(blob: bytes) -> int:
    """Write `blob` to standard output (a pipe or a redirect; it cannot be atomic) and return its size."""
    try:
        sys.stdout.buffer.write(blob)
        sys.stdout.buffer.flush()
    except OSError as exc:  # a closed pipe, a full disk behind a redirect
        raise OutputError(f"{STDOUT_NAME}: cannot write the cache ({exc.strerror or exc})") from None
    return len(blob)


def check_destination(path: Path, flag: str) -> None:
    """Refuse, before any long work, a target that `write_atomically` must not replace or could not create.

    A directory, device, FIFO or socket is a bad option (`UsageError`); a missing or read-only folder is an
    `OutputError`. The folder is probed by creating and removing a temp file, the only test that is right for root,
    ACLs and read-only mounts alike.
    """
    shown = f"{flag} {path}"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise OutputError(f"{shown}: cannot write it ({exc.strerror or exc})") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise UsageError(f"{shown} is a directory")
    if mode is not None and not stat.S_ISREG(mode):
        raise UsageError(f"{shown} is not a regular file (a device, FIFO or socket); give a file name, or - for"
                         " standard output")
    folder = path.parent
    if not folder.is_dir():
        raise OutputError(f"{shown}: the folder {folder} does not exist")
    try:
        fd, probe = _create_temp(path)
    except OSError as exc:
        raise OutputError(f"{shown}: cannot write in {folder} ({exc.strerror or exc})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        probe.unlink()


def write_atomically(path: Path, blob: bytes) -> None:
    """Write `blob` to `path` atomically; raises OSError (the caller words the error for its file kind)."""
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        _refuse_special(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _sync_directory(path.parent)


def _create_temp(path: Path) -> tuple[int, Path]:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp


def _refuse_special(path: Path) -> None:
    """Checked again just before the rename, for callers that skipped `check_destination`."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, "not a regular file")


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
