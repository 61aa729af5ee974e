"""Atomic file writes: readers see the old file or the new one, never half of one.

Every file klevict writes (`.kvc` caches, bench JSON) goes through here (and `-o -` through `write_stdout`): a temp file in the same directory, fsync,
rename over the target, then a best-effort sync of the directory. An interrupted write leaves no debris. Only a
regular file is ever replaced: a rename over `/dev/null`, a FIFO or a socket would destroy it. A symbolic link is
followed: its target is replaced, the link stays.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from klevict_cli.errors import OutputError, UsageError

# Output names that mean standard output; renaming a temp file over /dev/stdout would replace the device instead.
STDOUT_NAMES = ("-", "/dev/stdout")
STDOUT_NAME = "<stdout>"  # how messages name it


def is_stdout(path: Path | str) -> bool:
    return str(path) in STDOUT_NAMES


def write_stdout(blob: bytes) -> int:
    """Write `blob` to standard output (a pipe or a redirect; it cannot be atomic) and return its size; anything less
    than all of it, such as a reader that stops early, is an `OutputError` saying how much was delivered.

    A buffered write to a pipe whose reader has gone may return a short count instead of raising, so the count of
    every write is checked, and the rest written again until it fails or is done.
    """
    stream = sys.stdout.buffer
    view, done = memoryview(blob), 0
    try:
        while done < len(blob):
            written = stream.write(view[done:])
            if not written:  # None: a non-blocking stream that would block; 0: nothing can be written
                raise OSError(errno.EIO, "standard output takes no more data")
            done += written
        stream.flush()
    except OSError as exc:  # a closed pipe, a full disk behind a redirect
        silence_stdout()
        raise OutputError(f"{STDOUT_NAME}: cannot write the cache ({exc.strerror or exc}); {done:,} of its"
                          f" {len(blob):,} bytes were written") from None
    return len(blob)


CLOSED_PIPE = f"{STDOUT_NAME}: the reader closed it before the whole output was written"


class GuardedStdout:
    """Standard output for results and help: a write that fails is an `OutputError` — one line and exit 7, the
    documented code — not a traceback (a full disk or quota behind `> answers.txt`) nor rich's silent exit 1 (a
    reader that stopped early, `| head`). Everything else is the wrapped stream's; `write_stdout` writes the binary
    `.kvc` through its buffer and says how much got through."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if isinstance(text, str) and not text:  # click probes a stream with an empty write: nothing to fail on yet
            return 0
        return self._guarded(self._stream.write, text)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def _guarded(self, call, *args):
        try:
            return call(*args)
        except OSError as exc:
            silence_stdout()
            if exc.errno == errno.EPIPE:
                raise OutputError(CLOSED_PIPE) from None
            raise OutputError(f"{STDOUT_NAME}: cannot write the output ({exc.strerror or exc})") from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def silence_stdout() -> None:
    """After a write to standard output failed: point it at /dev/null, so that the flush at exit does not print
    Python's "Exception ignored … BrokenPipeError" over the one-line error."""
    try:
        fd = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):  # not a real file (a test's buffer), or already closed
        return
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def check_destination(path: Path, flag: str, inputs: Sequence[str | Path] = (), folder_hint: str = "",
                      replaces: tuple[str, Callable[[Path], bool]] | None = None, takes_stdout: bool = False) -> None:
    """Refuse, before any long work, a target that `write_atomically` must not replace or could not create.

    One of the command's `inputs` (a document, a cache) is never replaced by its output, whatever the path names it.
    `folder_hint` ends the message for a directory (what the command would do with one instead). `replaces`: (what
    the output is, whether an existing file is one) — an existing file that is not is refused, not replaced: `-o
    notes.md` meant for `notes.kvc` would otherwise destroy the notes. `takes_stdout`: the command writes standard
    output for `-` (compress -o), which a message about a device then suggests (--html and --out refuse `-`).

    The rules, one per kind of path: a symbolic link is followed, and the file it points to is what is written (the
    link stays); a directory is a bad option (`UsageError`); a device, FIFO or socket cannot be written as a file,
    and a folder that does not exist is never created: both are an `OutputError` (exit 7), as is a read-only folder.
    The folder is probed by creating and removing a temp file, the only test that is right for root, ACLs and
    read-only mounts alike.
    """
    shown = f"{flag} {path}"
    if str(path) == "-":  # elsewhere - is a standard stream: a file named "-" would surprise
        raise UsageError(f"{shown}: give a file name ({flag} does not write to standard output)")
    path = target_of(path)
    try:
        found = os.stat(path)
    except FileNotFoundError:
        found = None
    except OSError as exc:
        raise OutputError(f"{shown}: cannot write it ({exc.strerror or exc})") from None
    mode = found.st_mode if found is not None else None
    if mode is not None and stat.S_ISDIR(mode):
        raise UsageError(f"{shown} is a directory{folder_hint}")
    for source in inputs:
        if mode is not None and str(source) != "-" and same_file(path, Path(source)):
            raise UsageError(f"{shown} is the input {source}; choose another output path")
    if mode is not None and not stat.S_ISREG(mode):
        raise OutputError(f"{shown}: cannot write it: not a regular file (a device, FIFO or socket); give a file"
                          f" name{', or - for standard output' if takes_stdout else ''}")
    if found is not None and replaces is not None and found.st_size and not replaces[1](path):  # empty: free
        raise UsageError(f"{shown} exists and is not {replaces[0]}; klevict replaces only its own outputs: remove it"
                         " first or choose another name")
    folder = path.parent
    if not folder.is_dir():
        raise OutputError(f"{shown}: the folder {folder} does not exist (klevict creates no folders but a batch's"
                          " OUTDIR)")
    try:
        fd, probe = _create_temp(path)
    except OSError as exc:
        raise OutputError(f"{shown}: cannot write in {folder} ({exc.strerror or exc})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        probe.unlink()


def _starts_with(path: Path, *prefixes: bytes) -> bool:
    """Whether the file's first bytes, after blanks and any case, begin with one of `prefixes` (lower case)."""
    try:
        with open(path, "rb") as f:
            head = f.read(256).lstrip().lower()
    except OSError:
        return False
    return head.startswith(prefixes)


def is_html_file(path: Path) -> bool:
    """A page `--html` may replace: named .html / .htm, or beginning as one."""
    return path.suffix.lower() in (".html", ".htm") or _starts_with(path, b"<!doctype html", b"<html")


def is_json_file(path: Path) -> bool:
    """A result `bench --out` may replace: named .json, or beginning as a JSON object."""
    return path.suffix.lower() == ".json" or _starts_with(path, b"{")


def same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name one file: the same file where both exist, else the same path once links are resolved
    (two outputs of one command, neither written yet)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def target_of(path: Path) -> Path:
    """What writing `path` replaces: the file a symbolic link points to (followed to the end, even if it does not
    exist yet), else `path` itself."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def write_atomically(path: Path, blob: bytes) -> None:
    """Write `blob` to `path` (to the file it points to, if it is a symbolic link) atomically; raises OSError (the
    caller words the error for its file kind)."""
    path = target_of(path)
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
