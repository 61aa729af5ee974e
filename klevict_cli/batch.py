"""Compress a corpus: many documents, one model load, one `.kvc` each and a `manifest.jsonl` that records them all.

A batch must survive what a corpus throws at it: a bad document is recorded as failed and the rest go on; an
interrupted batch resumes where it stopped, because a document whose `.kvc` already holds the same source bytes
(sha256) read with the same settings by the same model is skipped; `--shard i/n` splits the work by source hash, so
any scheduler can run the shards with no coordination. The driver here does all the file writing (each `.kvc` and
each manifest line atomically); a worker only turns document bytes into `.kvc` bytes, so the same worker runs in
this process or on a Ray cluster (klevict_cli.batch_ray) and the outputs are the same.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from klevict_cli.documents import readable_name
from klevict_cli.errors import CacheFileError, DocumentError, KlevictError, OutputError, UsageError

MANIFEST = "manifest.jsonl"
DOCUMENT_SUFFIXES = (".txt", ".md", ".markdown", ".pdf")  # what a folder given as input contributes
EXIT_SOME_FAILED = 8
_GLOB_MAGIC = re.compile(r"[*?[]")
_UNSAFE = re.compile("\0+")


@dataclass
class Source:
    """One input document as the driver sees it, before any model work."""

    path: str
    kvc: str  # the output file name inside OUTDIR
    sha256: str | None  # of the raw bytes; None when the file cannot be read
    error: KlevictError | None = None


# ---- what to do ----------------------------------------------------------------------------------------------
def expand_inputs(inputs: Iterable[str]) -> list[str]:
    """Files, folders (their documents, recursively) and globs, in a stable order, each path once.

    A glob that matches nothing is a mistake in the command (exit 2, before the model loads); a plain path that
    does not exist is a document that fails, recorded like any other.
    """
    paths: list[str] = []
    for arg in inputs:
        if arg == "-":
            raise UsageError("standard input (-) cannot go into a batch (several documents, or -o OUTDIR/); give"
                             " file names, or -o NAME.kvc for standard input alone")
        if os.path.isdir(arg):
            found = sorted(str(p) for p in Path(arg).rglob("*")
                           if p.suffix.lower() in DOCUMENT_SUFFIXES and p.is_file())
            if not found:
                raise UsageError(f"{arg}: no documents in this folder ({', '.join(DOCUMENT_SUFFIXES)})")
            paths.extend(found)
        elif not os.path.exists(arg) and _GLOB_MAGIC.search(arg):
            found = sorted(p for p in glob.glob(arg, recursive=True) if os.path.isfile(p))
            if not found:
                raise UsageError(f"{arg}: no file matches this pattern")
            paths.extend(found)
        else:
            paths.append(arg)
    seen: set[str] = set()
    unique = []
    for path in paths:
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def is_batch(inputs: list[str], output: str | None) -> bool:
    """Several inputs, a folder or glob among them, or `-o OUTDIR/`: otherwise `compress` works as for one file."""
    if output and output.endswith(("/", os.sep)):
        return True
    return len(inputs) > 1 or any(os.path.isdir(a) or (not os.path.exists(a) and _GLOB_MAGIC.search(a))
                                  for a in inputs)


def output_folder(inputs: list[str], output: str | None) -> Path:
    """The batch's OUTDIR: given with a trailing /, an existing folder, or (for several inputs) a new name that
    does not look like a `.kvc` file."""
    if not output:
        raise UsageError("missing --output/-o: the folder for the .kvc files (e.g. -o caches/)")
    if output in ("-", "/dev/stdout"):
        raise UsageError("several documents cannot go to standard output; give a folder, e.g. -o caches/")
    path = Path(output)
    if path.is_dir():
        return path
    if path.exists():  # with a trailing / too (notes.txt/, /dev/full/): no folder can be made there
        raise UsageError(f"-o {output} is a file, not a folder; a batch (several documents, --shard or --engine ray)"
                         " writes into a folder (e.g. -o caches/)")
    if path.suffix.lower() == ".kvc" and not output.endswith(("/", os.sep)):
        raise UsageError(f"-o {output} names a file; a batch (several documents, --shard or --engine ray) writes into"
                         " a folder (end it with /, e.g. -o caches/)")
    return path


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """`i/n` with 0 <= i < n: this run takes shard i of n."""
    if text is None:
        return None
    match = re.fullmatch(r"([0-9]{1,6})/([0-9]{1,6})", text.strip())
    if not match or int(match[2]) < 1 or int(match[1]) >= int(match[2]):
        raise UsageError(f"invalid --shard {text!r}; give i/n with n from 1 to 999999 and i from 0 to n-1, e.g. 0/4")
    return int(match[1]), int(match[2])


def in_shard(key: str, shard: tuple[int, int] | None) -> bool:
    """Whether a document whose hash is `key` (hex) belongs to the shard: the same answer in every run."""
    return shard is None or int(key[:16], 16) % shard[1] == shard[0]


def safe_stem(stem: str) -> str:
    """A file name's stem as an output name: letters, digits and marks of any script ("Крейцерова соната", "हिन्दी"),
    '.', '-' and '_' stay (NFC); every run of anything else (spaces, punctuation, controls) is one '_'."""
    kept = "".join(c if c.isalnum() or c in "._-" or unicodedata.category(c).startswith("M") else "\0"
                   for c in unicodedata.normalize("NFC", stem))
    return _UNSAFE.sub("_", kept).strip("._") or "document"


def kvc_names(paths: list[str], owners: dict[str, str | None] | None = None) -> dict[str, str]:
    """Output names from the file names; names that would collide (case aside) all get a hash of their path.

    `owners` (`folder_owners`): the names taken in OUTDIR, to the source each was made from (None: a file no batch
    wrote). A source keeps the name it was given, and a name another source, or no source, holds counts as a
    collision, so that runs into one folder never write over each other's caches nor over a file no batch wrote.
    Computed over every input, before sharding, so that each shard names its documents as the whole batch does.
    """
    owners = owners or {}
    given = {source: name for name, source in owners.items() if source is not None}
    stems = {p: safe_stem(Path(p).stem) for p in paths}
    counts: dict[str, int] = {}
    for stem in stems.values():
        counts[stem.casefold()] = counts.get(stem.casefold(), 0) + 1
    names = {}
    for path, stem in stems.items():
        key = os.path.normpath(readable_name(path))  # as the manifest records it
        if key in given:
            names[path] = given[key]
            continue
        if counts[stem.casefold()] > 1 or owners.get(f"{stem}.kvc".casefold(), key) != key:
            stem = f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
        names[path] = stem + ".kvc"
    return names


def plan_sources(paths: list[str], shard: tuple[int, int] | None, folder: Path | None = None) -> list[Source]:
    """Hash each file's bytes (streamed) and keep this shard's; a file that cannot be a document (unreadable,
    binary from its first bytes, too large) is sharded by its path and fails later. `folder`: the OUTDIR whose
    names are taken (`folder_owners`)."""
    from klevict_cli.documents import source_sha256

    names = kvc_names(paths, folder_owners(folder) if folder is not None else None)
    sources = []
    for path in paths:
        try:
            digest, error = source_sha256(path), None
        except DocumentError as exc:
            digest, error = None, exc
        if in_shard(digest or hashlib.sha256(path.encode()).hexdigest(), shard):
            sources.append(Source(path, names[path], digest, error))
    return sources


def cache_paths(args: Iterable[Path]) -> list[Path]:
    """The caches `ask` answers from: `.kvc` files as given, and the `.kvc` files in each folder, by name; each once
    (`ask caches/ caches/a.kvc` answered a.kvc twice, as `compress` reads a document named twice once)."""
    caches: dict[Path, Path] = {}
    for arg in args:
        if arg.is_dir():
            found = sorted(arg.glob("*.kvc"))
            if not found:
                raise CacheFileError(f"{arg}: is a folder with no .kvc files in it")
        else:
            found = [arg]
        for path in found:
            caches.setdefault(path.resolve(), path)
    return list(caches.values())


# ---- the worker: bytes in, .kvc bytes out ----------------------------------------------------------------------
def settings_key(opts: dict, identity: dict[str, str]) -> str:
    """What must match for an existing `.kvc` to count as done: every reading setting and the model's identity."""
    return json.dumps({**_settings(opts), **identity}, sort_keys=True)


def quick_key(opts: dict) -> str | None:
    """What lets a re-run skip a document without loading the model (seconds of imports and loading): every reading
    setting, the model as named, and the size and mtime of each of its files. Only for a model that is packaged or
    a local folder or file (None for a hub id); a changed file, or any other doubt, falls back to `settings_key`."""
    stamp = model_stamp(opts.get("model"))
    return None if stamp is None else json.dumps({**_settings(opts), "model": opts["model"], "files": stamp},
                                                 sort_keys=True)


def _settings(opts: dict) -> dict:
    from klevict_cli.reading import read_options  # no torch: the options checked, nothing loaded

    settings = read_options(opts, reconstruct_default=True)
    return {
        "budget": str(settings["budget"]), "method": settings["method"], "chunk_size": settings["chunk_size"],
        "probe_window": settings["probe_window"], "position_mode": settings["position_mode"],
        "seed": settings["seed"], "working": str(settings["working"]), "reconstruct": settings["reconstruct"],
        "max_new_tokens": settings["max_new_tokens"], "max_memory": settings["max_memory"],
        "cache_dtype": opts.get("cache_dtype"),
        **({"max_kl": settings["max_kl"]} if settings["max_kl"] is not None else {}),  # older manifests have none
        **({"max_bytes": str(settings["max_bytes"])} if settings["max_bytes"] is not None else {}),
        # --estimate / --no-estimate; the default (where the read is long enough) keeps older manifests' keys
        **({"measure_drift": settings["measure_drift"]} if settings["measure_drift"] is not None else {}),
    }


def model_stamp(spec: str | None) -> list | None:
    """The path, size and mtime of a local or packaged model's files (hidden files aside: klevict keeps its weight
    digests in one), or None for a hub id or anything unreadable."""
    from klevict_cli.errors import ModelError
    from klevict_cli.packaged import DEFAULT_MODEL, PACKAGED_MODELS, packaged_files

    spec = spec or DEFAULT_MODEL
    try:
        if spec in PACKAGED_MODELS:
            stats = [(p, p.stat()) for p in packaged_files(spec)]
            return [spec, *([str(p), info.st_size, info.st_mtime_ns] for p, info in stats)]
    except (OSError, ModelError):
        return None
    path = Path(spec).expanduser()
    try:
        if path.is_file():
            info = path.stat()
            return [str(path.resolve()), info.st_size, info.st_mtime_ns]
        if path.is_dir():
            files = sorted((p.name, p.stat()) for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
            return [str(path.resolve()), *([name, info.st_size, info.st_mtime_ns] for name, info in files)]
    except OSError:
        return None
    return None


class Worker:
    """One model load that compresses documents given as bytes; it never writes a file, so a worker killed
    mid-document leaves nothing behind."""

    def __init__(self, opts: dict):
        from klevict_cli.reading import prepare_session, read_settings, session_for

        self.opts = opts
        self.session = session_for(opts)
        self.settings = read_settings(opts, reconstruct_default=True)
        prepare_session(self.session, self.settings)
        self._key = settings_key(opts, self.session.identity())
        self._quick = quick_key(opts)

    def key(self) -> str:
        return self._key

    def compress(self, path: str, kvc: str, data: bytes,
                 progress: Callable[[int, int], None] | None = None) -> tuple[dict, bytes | None]:
        """The manifest record and the `.kvc` bytes (None if the document failed) for one document."""
        from klevict_cli.documents import document_from_bytes
        from klevict_cli.kvc import encode_kvc

        record = {"source": readable_name(path), "source_file_sha256": hashlib.sha256(data).hexdigest(), "kvc": kvc}
        start = time.perf_counter()
        try:
            document = document_from_bytes(path, data)
            result = self.session.read(document, self.settings, progress)
            cache = self.session.cache_file(result, cache_dtype=self.opts.get("cache_dtype"))
            # the read as one document's `compress --json` reports it (the same keys, for scripts and the manifest)
            summary = self.session.stored_summary(result, cache)
            cache.metadata.update(source_file_sha256=record["source_file_sha256"], batch_settings=self._key,
                                  kept_entries=str(summary["kept_entries"]),
                                  **({"batch_quick": self._quick} if self._quick else {}))
            blob = encode_kvc(cache, kvc)
        except Exception as exc:  # a bad document must not stop the batch; the record says what went wrong
            return {**record, "status": "failed", "error": type(exc).__name__, "message": str(exc)}, None
        notes = {"notes": list(document.notes)} if document.notes else {}  # e.g. how an encoding was guessed
        return {**record, "document_tokens": result.document_tokens, "bytes": len(blob),
                "seconds": round(time.perf_counter() - start, 3), "status": "ok", **summary, **notes}, blob


class LocalEngine:
    """The batch in this process: one model load, documents one after another in input order. The model is loaded
    when first needed: a re-run whose documents are all done (`quick_key`) never loads it."""

    def __init__(self, opts: dict, on_tokens: Callable[[str, int, int], None] | None = None):
        self.opts = opts
        self._worker: Worker | None = None
        self.on_tokens = on_tokens

    @property
    def worker(self) -> Worker:
        if self._worker is None:
            self._worker = Worker(self.opts)
        return self._worker

    def quick_key(self) -> str | None:
        return quick_key(self.opts)

    def key(self) -> str:
        return self.worker.key()

    def run(self, sources: list[Source]) -> Iterator[tuple[int, dict, bytes | None]]:
        """Results in input order, each with its index in `sources`."""
        from klevict_cli.documents import read_source

        for index, source in enumerate(sources):
            def progress(done: int, total: int, path=source.path) -> None:
                if self.on_tokens is not None:
                    self.on_tokens(path, done, total)

            try:
                data = read_source(source.path)
            except DocumentError as exc:
                yield index, failed(source, exc), None
                continue
            yield index, *self.worker.compress(source.path, source.kvc, data, progress)

    def close(self) -> None:
        pass


def failed(source: Source, exc: Exception) -> dict:
    return {"source": readable_name(source.path), "source_file_sha256": source.sha256, "kvc": source.kvc,
            "status": "failed", "error": type(exc).__name__, "message": str(exc)}


# ---- the driver ----------------------------------------------------------------------------------------------
def manifest_text(path: Path) -> str:
    """The manifest's text ('' where there is none yet, nor a folder for it: prepare_folder says why)."""
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return ""
    except OSError as exc:
        raise OutputError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def written(text: str) -> Iterator[dict]:
    """The manifest's records of caches written (status ok), in order; torn or foreign lines are skipped."""
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("status") == "ok" and isinstance(entry.get("kvc"), str):
            yield entry


def file_sha256(entry: dict) -> str | None:
    """A manifest line's sha256 of its source file's bytes: `source_file_sha256`, the name the `.kvc` gives it, or
    `source_sha256` in manifests of earlier versions (a name the `.kvc` uses for the hash of the text)."""
    return entry.get("source_file_sha256", entry.get("source_sha256"))


def manifest_owners(folder: Path) -> dict[str, str]:
    """Each cache name in `folder` (case folded) -> the source (normalised path) its latest write was made from."""
    return {entry["kvc"].casefold(): os.path.normpath(str(entry.get("source")))
            for entry in written(manifest_text(folder / MANIFEST))}


def folder_owners(folder: Path) -> dict[str, str | None]:
    """Each name a `.kvc` in `folder` holds (case folded) -> its source: the manifest's, else that of a cache a
    batch wrote before a crash took its line (`batch_source`), else None: a file no batch wrote, never replaced."""
    owners = manifest_owners(folder)
    # iterdir, not glob("*.kvc"): a file system blind to case holds Report.KVC where report.kvc would go
    held = folder.iterdir() if folder.is_dir() else ()
    unowned = {path.name.casefold(): batch_source(path) for path in held
               if path.suffix.casefold() == ".kvc" and path.name.casefold() not in owners}
    return {**unowned, **owners}  # the manifest's names last: a source keeps the name the manifest gives it


def batch_source(path: Path) -> str | None:
    """The source (normalised path) a batch made the cache at `path` from, or None for any other file (only a
    batch records `source_file_sha256`) and for one that cannot be read."""
    from klevict_cli.kvc import read_metadata

    try:
        meta = read_metadata(path)
    except KlevictError:
        return None
    if "source_file_sha256" not in meta or not meta.get("source_name"):
        return None
    return os.path.normpath(meta["source_name"])


class Manifest:
    """`manifest.jsonl`: one line per document, each appended with a single write (whole lines, even from several
    shards at once); the last line for a source is its current state."""

    def __init__(self, folder: Path):
        self.path = folder / MANIFEST
        self.done: set[tuple[str, str]] = set()  # (kvc, source file's sha256) recorded as ok
        text = manifest_text(self.path)
        if text and not text.endswith("\n"):  # a line torn by a crash: never glue the next one onto it
            self._append(b"\n")
        self.done.update((entry["kvc"], file_sha256(entry)) for entry in written(text))

    def add(self, record: dict) -> None:
        self._append((json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n").encode())
        if record["status"] == "ok":
            self.done.add((record["kvc"], file_sha256(record)))

    def _append(self, data: bytes) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                if os.write(fd, data) != len(data):
                    raise OSError("short write")
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot write it ({exc.strerror or exc})") from None


def finished(folder: Path, source: Source, key: Callable[[], str], quick: str | None = None) -> dict | None:
    """The manifest record of `source`'s existing `.kvc` if it was made from the same bytes with the same settings
    and model, else None (then the document is read again). The model's identity (`key()`, which loads the model)
    is asked for only when the file does not match `quick` (see `quick_key`)."""
    from klevict_cli.kvc import read_metadata

    try:
        meta = read_metadata(folder / source.kvc)
    except KlevictError:
        return None
    if meta.get("source_file_sha256") != source.sha256:
        return None
    if not (quick is not None and meta.get("batch_quick") == quick) and meta.get("batch_settings") != key():
        return None
    return {"source": readable_name(source.path), "source_file_sha256": source.sha256, "kvc": source.kvc,
            "document_tokens": int(meta.get("document_tokens", 0)), "kept_entries": int(meta.get("kept_entries", 0)),
            "bytes": int(meta["file_size"]), "seconds": None, "status": "ok"}


def prepare_folder(folder: Path) -> None:
    from klevict_cli.files import check_destination

    try:
        folder.mkdir(exist_ok=True)  # OUTDIR itself, never missing folders above it (as -o FILE creates none)
    except FileNotFoundError:
        raise OutputError(f"-o {folder}: the folder {folder.parent} does not exist (klevict creates OUTDIR but no"
                          " folder above it)") from None
    except OSError as exc:
        raise OutputError(f"-o {folder}: cannot create the folder ({exc.strerror or exc})") from None
    check_destination(folder / MANIFEST, "-o")


def run_batch(sources: list[Source], folder: Path, engine,
              on_record: Callable[[dict], None] = lambda record: None) -> dict[str, int]:
    """Compress `sources` into `folder` with `engine`. Each `.kvc` is written as soon as it arrives, its manifest
    line once those of the documents before it are written, so that every engine writes the same manifest.
    Returns counts of ok, skipped and failed documents."""
    from klevict_cli.files import write_atomically

    manifest = Manifest(folder)
    quick = engine.quick_key() if hasattr(engine, "quick_key") else None
    counts = {"ok": 0, "skipped": 0, "failed": 0}
    todo = []
    for source in sources:
        if source.error is not None:
            record = failed(source, source.error)
        elif (record := finished(folder, source, engine.key, quick)) is not None:
            if (source.kvc, source.sha256) not in manifest.done:  # written, then interrupted before its line
                manifest.add(record)
            record = {**record, "status": "skipped"}
        else:
            todo.append(source)
            continue
        if record["status"] == "failed":
            manifest.add(record)
        counts[record["status"]] += 1
        on_record(record)
    waiting: dict[int, dict] = {}
    next_line = 0
    for index, record, blob in engine.run(todo):
        if blob is not None:
            try:
                write_atomically(folder / record["kvc"], blob)
            except OSError as exc:
                raise OutputError(f"{folder / record['kvc']}: cannot write the cache ({exc.strerror or exc})") \
                    from None
        waiting[index] = record
        while next_line in waiting:
            record = waiting.pop(next_line)
            next_line += 1
            manifest.add(record)
            counts[record["status"]] += 1
            on_record(record)
    return counts
