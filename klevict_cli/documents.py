"""Load a document (text file, PDF, or stdin) as normalised text.

Normalising first means the same content gives the same text, and so the same hash, whether it came with CRLF line
ends, a BOM, decomposed accents or ragged spacing; a saved cache can then be matched to its document by hash.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import io
import itertools
import logging
import os
import re
import stat
import sys
import unicodedata
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from klevict_cli.errors import DocumentError

STDIN_NAME = "<stdin>"

# Reading is bounded: a document is read CHUNK bytes at a time, the first SNIFF bytes decide what it is (binary files
# are refused there, however large), and no document may exceed MAX_DOCUMENT_BYTES (1 GiB, some 250 million tokens:
# weeks of reading on a CPU, and more memory for its token ids than most machines have).
SNIFF = 64 * 1024
CHUNK = 1024 * 1024
MAX_DOCUMENT_BYTES = 1024**3

# Bytes that are not UTF-8 are replaced (and a note says so) while they are at most 1% of the characters, or while
# valid multi-byte UTF-8 characters outnumber them ten to one (UTF-8 text with a few damaged bytes).
MAX_REPLACEMENT_SHARE = 0.01
UTF8_EVIDENCE = 10
# Binary, not text in some other encoding: undecodable bytes and control characters are more than BINARY_SHARE of
# it, and control characters more than CONTROL_SHARE (text in any 8-bit encoding has next to none).
BINARY_SHARE = 0.3
CONTROL_SHARE = 0.01

# Vertical whitespace other than "\n": form feed (a page break) and the Unicode paragraph separator start a new
# paragraph; the rest end a line.
_LINE_BREAKS = str.maketrans({"\f": "\n\n", "\u2029": "\n\n", "\v": "\n", "\x85": "\n", "\u2028": "\n"})
_SPACE_RUN = re.compile(r"[ \t]+")
_TRAILING_SPACE = re.compile(r" +\n")
_PARAGRAPH_BREAK = re.compile(r"\n{3,}")

# Undecodable bytes, decoded with "surrogateescape", are the lone surrogates U+DC80..U+DCFF: one per byte, so that
# the bytes can be counted, located, and turned into Windows-1252 characters without reading the file again.
_BAD_BYTE = re.compile("[\udc80-\udcff]")
_NOT_IN_CP1252 = re.compile("[\udc81\udc8d\udc8f\udc90\udc9d]")  # the five bytes Windows-1252 leaves undefined
_ASCII = re.compile("[\x00-\x7f]+")
# Control characters a text file does not hold (tab, line feed, vertical tab, form feed and carriage return it may).
_CONTROL = re.compile("[\x01-\x08\x0e-\x1f\x7f]")
_CP1252 = {chr(0xDC00 + b): bytes([b]).decode("cp1252") for b in range(0x80, 0x100)
           if b not in (0x81, 0x8D, 0x8F, 0x90, 0x9D)}


@dataclass(frozen=True)
class Document:
    text: str
    name: str
    sha256: str
    notes: tuple[str, ...] = ()  # what the user should know about how it was read (e.g. a guessed encoding)


def load_document(source: str) -> Document:
    """Read ``source`` (a path, or ``-`` for stdin) and return its normalised text.

    A ``.pdf`` suffix or ``%PDF-`` content means PDF (its text layer is used, pages joined by a blank line);
    anything else is read as text, see ``decode_text``. The file is read in chunks and never held whole as bytes
    (except a PDF); a binary file is refused from its first bytes. Every failure is a one-line ``DocumentError``
    naming the file.
    """
    if source == "-":
        return _document(STDIN_NAME, _chunks(STDIN_NAME, *_open_stdin()))
    return _document(source, _chunks(source, *_open_file(Path(source))))


def read_source(source: str) -> bytes:
    """The raw bytes of a document file, for a batch worker; a file that cannot be a document (binary, too large) is
    refused before it is read whole."""
    return b"".join(_checked_chunks(source, _chunks(source, *_open_file(Path(source)))))


def source_sha256(source: str) -> str:
    """The sha256 of a document file's bytes, read in chunks (a batch shards and resumes by it); refused as
    `read_source` would refuse it."""
    digest = hashlib.sha256()
    for chunk in _checked_chunks(source, _chunks(source, *_open_file(Path(source)))):
        digest.update(chunk)
    return digest.hexdigest()


def document_from_bytes(name: str, data: bytes) -> Document:
    """The document in `data`, named `name` in messages: a batch worker may get the bytes, not the file."""
    view = memoryview(data)
    return _document(name, (bytes(view[i:i + CHUNK]) for i in range(0, len(data), CHUNK)))


def readable_name(name: str) -> str:
    """A file name as text that can be stored (a .kvc's metadata, JSON) and printed: bytes of it that are not UTF-8,
    which Python holds as lone surrogates, written as \\xNN escapes."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no byte made
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _document(name: str, chunks: Iterator[bytes]) -> Document:
    name = readable_name(name)
    first = next(chunks, b"")
    if not first:
        raise DocumentError(f"{name}: is empty" + (" (nothing was piped in)" if name == STDIN_NAME else ""))
    if first.startswith(b"%PDF-") or (name != STDIN_NAME and name.lower().endswith(".pdf")):
        raw, notes = _pdf_text(name, b"".join(itertools.chain([first], chunks))), ()
    else:
        raw, notes = decode_chunks(name, itertools.chain([first], chunks))
    text = normalise(raw)
    del raw  # keep at most the text and one normalised copy alive from here on
    if not text:
        raise DocumentError(f"{name}: is empty (only whitespace)")
    return Document(text=text, name=name, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(), notes=notes)


def normalise(text: str) -> str:
    """Canonical form: NFC, "\\n" line ends, single spaces, at most one blank line, no edge whitespace.

    Whitespace is only ever shortened, never removed from between two words, so no words are joined.
    """
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").translate(_LINE_BREAKS)
    text = _SPACE_RUN.sub(" ", text)
    text = _TRAILING_SPACE.sub("\n", text)
    text = _PARAGRAPH_BREAK.sub("\n\n", text)
    return text.strip()


def decode_text(name: str, data: bytes) -> tuple[str, str | None]:
    """`decode_chunks` of bytes held whole; returns the text and the first note, if any."""
    text, notes = decode_chunks(name, iter([data]))
    return text, notes[0] if notes else None


def decode_typed(name: str, typed: str | bytes) -> tuple[str, tuple[str, ...]]:
    """What the user typed (a question, a prompt; from the command line or standard input), decoded as a document is:
    Python holds an argument's bytes that are not UTF-8 as lone surrogates (surrogateescape), which the tokenizer
    cannot take, so they are turned back into bytes and read by the documents' rules (Windows-1252, U+FFFD)."""
    if isinstance(typed, str):
        try:
            typed = typed.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate no byte made: not text a tokenizer reads
            typed = typed.encode("utf-8", "replace")
    return decode_chunks(name, iter([typed]))


def decode_chunks(name: str, chunks: Iterator[bytes]) -> tuple[str, tuple[str, ...]]:
    """Decode a document's bytes, given in order as chunks (the first at least SNIFF bytes, or all of them), or
    refuse them; returns the text and notes on how it was read.

    Policy: a UTF-16 byte order mark means UTF-16, and so does a start whose every other byte is NUL (mostly Latin
    UTF-16 without a BOM; a note says which byte order was assumed). Otherwise a NUL byte means binary, refused as
    soon as it is read. Valid UTF-8 is used as is, minus a BOM. Bytes with no valid multi-byte UTF-8 sequence at all
    that read as Windows-1252 without control characters are Windows-1252, with a note saying so and where the first
    such byte is. Otherwise bytes that are not UTF-8 are replaced by U+FFFD, with a note saying how many and where
    the first is, while they are few (see MAX_REPLACEMENT_SHARE and UTF8_EVIDENCE); more than that is refused: as
    binary when undecodable bytes and control characters are more than BINARY_SHARE of it, else as text in an
    encoding klevict does not read, saying where the first bad byte is.
    """
    first = next(chunks, b"")
    utf16 = _utf16_order(first)
    if utf16 is not None:
        return _decode_utf16(name, utf16, itertools.chain([first], chunks))
    return _decode_utf8(name, itertools.chain([first], chunks))


def _utf16_order(prefix: bytes) -> str | None:
    """'utf-16' (a BOM), 'utf-16-le' or 'utf-16-be' (no BOM, every other byte NUL), or None."""
    if prefix.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "utf-16"
    pairs = len(prefix) // 2
    if pairs < 2:
        return None
    even, odd = prefix[0:2 * pairs:2].count(0), prefix[1:2 * pairs:2].count(0)
    if even == 0 and odd >= pairs / 2:
        return "utf-16-le"
    if odd == 0 and even >= pairs / 2:
        return "utf-16-be"
    return None


def _decode_utf16(name: str, encoding: str, chunks: Iterator[bytes]) -> tuple[str, tuple[str, ...]]:
    decoder = codecs.getincrementaldecoder(encoding)("strict")
    parts, offset = [], 0
    try:
        for chunk in chunks:
            parts.append(decoder.decode(chunk))
            offset += len(chunk)
            if "\x00" in parts[-1]:
                raise DocumentError(f"{name}: looks like a binary file, not text (a NUL character in UTF-16 text)")
        parts.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError as exc:
        where = f"near byte {offset + exc.start}" if exc.start < len(exc.object) else "at its end"
        shown = "UTF-16" if encoding == "utf-16" else f"UTF-16 ({_ORDER[encoding]}, assumed from its NUL bytes)"
        raise DocumentError(f"{name}: is not valid {shown} ({where}); convert it to UTF-8 first") from None
    notes = () if encoding == "utf-16" else (
        f"{name} has no byte order mark but every other byte is NUL; read it as UTF-16 {_ORDER[encoding]}",)
    return "".join(parts), notes


_ORDER = {"utf-16-le": "little-endian", "utf-16-be": "big-endian"}


@dataclass
class _Tally:
    """What the UTF-8 decoding found so far, counted in characters of the decoded text."""

    chars: int = 0
    bad: int = 0  # bytes that are not UTF-8
    multibyte: int = 0  # valid non-ASCII characters
    controls: int = 0
    cp1252: bool = True  # every bad byte is a Windows-1252 character
    first_bad: tuple[int, int, int] | None = None  # (byte value, line, byte offset) of the first bad byte
    lines: int = 0  # line feeds before the current piece
    offset: int = 0  # bytes before the current piece, while no bad byte has been found

    def add(self, name: str, piece: str) -> None:
        if not piece.isascii():
            bad = len(_BAD_BYTE.findall(piece))
            non_ascii = len(_ASCII.sub("", piece))
            if bad:
                if self.first_bad is None:
                    i = _BAD_BYTE.search(piece).start()
                    self.first_bad = (ord(piece[i]) - 0xDC00, self.lines + piece.count("\n", 0, i) + 1,
                                      self.offset + len(piece[:i].encode("utf-8", "surrogateescape")))
                self.cp1252 = self.cp1252 and _NOT_IN_CP1252.search(piece) is None
            self.bad += bad
            self.multibyte += non_ascii - bad
            controls = len(_CONTROL.findall(piece))
            # a stretch of undecodable bytes and control characters is binary: refuse it now, not at the end
            if _binary(bad, controls, len(piece)):
                raise DocumentError(f"{name}: looks like a binary file, not text (at line {self.lines + 1}, it is"
                                    " neither UTF-8 nor text)")
        else:
            controls = len(_CONTROL.findall(piece))
        self.controls += controls
        self.chars += len(piece)
        self.lines += piece.count("\n")
        if self.first_bad is None:
            self.offset += len(piece) if piece.isascii() else len(piece.encode("utf-8", "surrogateescape"))


def _nul_byte(name: str, offset: int) -> DocumentError:
    """A NUL byte: binary, or a .kvc cache given for a document (`klevict summarize report.kvc`), said as such."""
    if name.lower().endswith(".kvc"):
        return DocumentError(f"{name}: is a .kvc cache, not a document; ask it with klevict ask {name} QUESTION")
    return DocumentError(f"{name}: looks like a binary file, not text (a NUL byte at offset {offset})")


def _binary(bad: int, controls: int, chars: int) -> bool:
    return bad > 0 and controls > CONTROL_SHARE * chars and bad + controls > BINARY_SHARE * chars


def _decode_utf8(name: str, chunks: Iterator[bytes]) -> tuple[str, tuple[str, ...]]:
    decoder = codecs.getincrementaldecoder("utf-8-sig")("surrogateescape")
    tally, parts, offset = _Tally(), [], 0
    for chunk in chunks:
        nul = chunk.find(0)
        if nul >= 0:
            raise _nul_byte(name, offset + nul)
        if offset == 0 and chunk.startswith(codecs.BOM_UTF8):
            tally.offset = len(codecs.BOM_UTF8)
        offset += len(chunk)
        parts.append(decoder.decode(chunk))
        tally.add(name, parts[-1])
    parts.append(decoder.decode(b"", final=True))
    tally.add(name, parts[-1])
    text = "".join(parts)
    del parts
    if not tally.bad:
        return text, ()
    byte, line, at = tally.first_bad
    where = f"byte 0x{byte:02x} at line {line}, offset {at}"
    if not tally.multibyte and tally.cp1252 and not tally.controls:
        latin = _BAD_BYTE.sub(lambda m: _CP1252[m.group()], text)
        count = "1 non-ASCII" if tally.bad == 1 else f"{tally.bad} non-ASCII bytes, the first"
        return latin, (f"{name} is not UTF-8 ({count} {where}); read it as"
                       f" Windows-1252 (Latin-1), in which that byte is '{bytes([byte]).decode('cp1252')}'",)
    if tally.bad <= MAX_REPLACEMENT_SHARE * tally.chars or tally.multibyte >= UTF8_EVIDENCE * tally.bad:
        shown = "1 byte is" if tally.bad == 1 else f"{tally.bad} bytes are"
        return _BAD_BYTE.sub("\ufffd", text), (f"{name}: {shown} not valid UTF-8 (the first, {where}); read as"
                                                " U+FFFD (\ufffd)",)
    if _binary(tally.bad, tally.controls, tally.chars):
        raise DocumentError(f"{name}: looks like a binary file, not text ({_share_not_utf8(tally.bad, offset)})")
    raise DocumentError(f"{name}: is not UTF-8 ({where}; {_share_not_utf8(tally.bad, offset)}); convert it first,"
                        " e.g. iconv -f ITS-ENCODING -t UTF-8")


def _share_not_utf8(bad: int, total: int) -> str:
    """'1 of its 40 bytes is not UTF-8', '3 of its 40 bytes are not UTF-8'."""
    return f"{bad} of its {total} bytes {'is' if bad == 1 else 'are'} not UTF-8"


# ---- bounded reading ------------------------------------------------------------------------------------------
def _open_file(path: Path) -> tuple[BinaryIO, int | None]:
    name = str(path)
    try:
        stream = open(path, "rb")  # noqa: SIM115 (closed by _chunks)
    except FileNotFoundError:
        raise DocumentError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise DocumentError(f"{name}: is a directory, not a file") from None
    except PermissionError:
        raise DocumentError(f"{name}: permission denied") from None
    except OSError as exc:
        raise DocumentError(f"{name}: cannot read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(stream.fileno())
    except OSError:
        info = None
    if info is not None and stat.S_ISDIR(info.st_mode):
        stream.close()
        raise DocumentError(f"{name}: is a directory, not a file")
    return stream, info.st_size if info is not None and stat.S_ISREG(info.st_mode) else None


def _open_stdin() -> tuple[BinaryIO, None]:
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None or getattr(stream, "closed", False):
        raise DocumentError(f"{STDIN_NAME}: standard input is closed")
    return stream, None


def _chunks(name: str, stream: BinaryIO, size: int | None) -> Iterator[bytes]:
    """The bytes of `stream`: first SNIFF bytes (or all there are), then CHUNK bytes at a time. A regular file larger
    than MAX_DOCUMENT_BYTES is refused after its first chunk (so that a binary file is still called binary), a pipe
    once it has given that much."""
    total = 0
    try:
        with contextlib.ExitStack() as stack:
            if stream is not getattr(sys.stdin, "buffer", None):
                stack.enter_context(stream)
            want = SNIFF
            while True:
                chunk = _read_fully(stream, want)
                if not chunk:
                    return
                total += len(chunk)
                if total > MAX_DOCUMENT_BYTES:
                    raise _too_large(name, None)
                yield chunk
                if want == SNIFF and size is not None and size > MAX_DOCUMENT_BYTES:
                    raise _too_large(name, size)
                want = CHUNK
    except ValueError:  # "I/O operation on closed file"
        raise DocumentError(f"{name}: " + ("standard input is closed" if name == STDIN_NAME else "was closed")) \
            from None
    except OSError as exc:
        raise DocumentError(f"{name}: cannot read: {exc.strerror or exc}") from None


def _read_fully(stream: BinaryIO, want: int) -> bytes:
    """Up to `want` bytes, fewer only at the end (a pipe may give less per read)."""
    data = stream.read(want)
    if not data or len(data) == want:
        return data or b""
    parts = [data]
    got = len(data)
    while got < want:
        more = stream.read(want - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _too_large(name: str, size: int | None) -> DocumentError:
    shown = f" ({size / 2**30:.2f} GiB)" if size is not None else ""
    return DocumentError(f"{name}: is too large{shown}; klevict reads documents of at most"
                         f" {MAX_DOCUMENT_BYTES // 2**30} GiB; split it")


def _checked_chunks(name: str, chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The chunks, refusing what cannot be a document as soon as it shows: a NUL byte outside UTF-16 text or a PDF
    (see `decode_chunks`), more than MAX_DOCUMENT_BYTES. Cheap: nothing is decoded."""
    first = next(chunks, b"")
    binary_ok = first.startswith(b"%PDF-") or name.lower().endswith(".pdf") or _utf16_order(first) is not None
    offset = 0
    for chunk in itertools.chain([first], chunks):
        nul = -1 if binary_ok else chunk.find(0)
        if nul >= 0:
            raise _nul_byte(name, offset + nul)
        offset += len(chunk)
        yield chunk


def _pdf_text(name: str, data: bytes) -> str:
    """The text layer of every page, pages separated by a blank line."""
    from pypdf import PdfReader  # imported here so text-only runs never pay for it

    with _pypdf_warnings_captured() as warned:
        try:
            reader = PdfReader(io.BytesIO(data))
            if reader.is_encrypted:
                _decrypt_with_empty_password(name, reader)
            pages = [(page.extract_text() or "").replace("\x00", "") for page in reader.pages]
        except DocumentError:
            raise
        except Exception as exc:  # pypdf raises many exception types for damaged files
            hint = f" ({_short_reason(warned[0])})" if warned else ""
            raise DocumentError(f"{name}: cannot read PDF: {_short_reason(exc)}{hint}") from None
    if not pages:
        raise DocumentError(f"{name}: PDF has no pages")
    if not any(page.strip() for page in pages):
        raise DocumentError(f"{name}: has no text layer (scanned?); run OCR first")
    return "\n\n".join(pages)


@contextlib.contextmanager
def _pypdf_warnings_captured():
    """Keep pypdf's log warnings off stderr (errors must be one line); the first often names the real damage."""
    warned: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    logger = logging.getLogger("pypdf")
    handler, propagate = Collect(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield warned
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _decrypt_with_empty_password(name: str, reader) -> None:
    """Many PDFs are 'encrypted' only to set permissions and open with an empty password."""
    try:
        opened = reader.decrypt("")
    except Exception as exc:
        raise DocumentError(f"{name}: PDF is encrypted and cannot be opened: {_short_reason(exc)}") from None
    if not opened:  # PasswordType.NOT_DECRYPTED == 0
        raise DocumentError(f"{name}: PDF is encrypted with a password; decrypt it first (e.g. qpdf --decrypt)")


def _short_reason(exc: Exception | str, limit: int = 120) -> str:
    lines = str(exc).strip().splitlines()
    reason = lines[0] if lines else type(exc).__name__
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."
