"""Load a document (text file, PDF, or stdin) as normalised text.

Normalising first means the same content gives the same text, and so the same hash, whether it came with CRLF line
ends, a BOM, decomposed accents or ragged spacing; a saved cache can then be matched to its document by hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import re
import sys
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path

from klevict_cli.errors import DocumentError

STDIN_NAME = "<stdin>"

# More than this share of U+FFFD after a lenient decode means the bytes are not UTF-8 text.
MAX_REPLACEMENT_SHARE = 0.01

# Vertical whitespace other than "\n": form feed (a page break) and the Unicode paragraph separator start a new
# paragraph; the rest end a line.
_LINE_BREAKS = str.maketrans({"\f": "\n\n", "\u2029": "\n\n", "\v": "\n", "\x85": "\n", "\u2028": "\n"})
_SPACE_RUN = re.compile(r"[ \t]+")
_TRAILING_SPACE = re.compile(r" +\n")
_PARAGRAPH_BREAK = re.compile(r"\n{3,}")


@dataclass(frozen=True)
class Document:
    text: str
    name: str
    sha256: str
    notes: tuple[str, ...] = ()  # what the user should know about how it was read (e.g. a guessed encoding)


def load_document(source: str) -> Document:
    """Read ``source`` (a path, or ``-`` for stdin) and return its normalised text.

    A ``.pdf`` suffix or ``%PDF-`` content means PDF (its text layer is used, pages joined by a blank line);
    anything else is read as text, see ``decode_text``. Every failure is a one-line ``DocumentError``
    naming the file.
    """
    if source == "-":
        return document_from_bytes(STDIN_NAME, _read_stdin())
    return document_from_bytes(source, read_source(source))


def read_source(source: str) -> bytes:
    """The raw bytes of a document file; a batch hashes them to shard and resume without extracting any text."""
    return _read_file(Path(source))


def document_from_bytes(name: str, data: bytes) -> Document:
    """The document in `data`, named `name` in messages: a batch worker may get the bytes, not the file."""
    if not data:
        raise DocumentError(f"{name}: is empty" + (" (nothing was piped in)" if name == STDIN_NAME else ""))
    is_pdf = data.startswith(b"%PDF-") or (name != STDIN_NAME and name.lower().endswith(".pdf"))
    raw, guessed = (_pdf_text(name, data), None) if is_pdf else decode_text(name, data)
    del data  # keep at most the text and one normalised copy alive from here on
    text = normalise(raw)
    del raw
    if not text:
        raise DocumentError(f"{name}: is empty (only whitespace)")
    notes = (guessed,) if guessed else ()
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
    """Decode bytes as text, or reject them as binary; returns the text and a note when the encoding was guessed.

    Policy: a UTF-16 BOM means UTF-16 (what some Windows editors write). Otherwise any NUL byte means binary.
    Valid UTF-8 is used as is, minus a BOM. Bytes with no valid multi-byte UTF-8 sequence at all that read as
    Windows-1252 (a superset of Latin-1's printable characters) without control characters are Windows-1252: UTF-8
    text almost never looks like that by accident. Otherwise invalid UTF-8 is decoded with U+FFFD replacements and
    accepted if at most 1% of the characters are replacements (a stray bad byte in a long text). Anything else is
    refused: as text in another encoding (saying where the first bad byte is) if it is mostly ASCII text, else as
    binary.
    """
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16"), None
        except UnicodeDecodeError:
            raise DocumentError(f"{name}: has a UTF-16 byte order mark but is not valid UTF-16") from None
    if b"\x00" in data:
        raise DocumentError(f"{name}: looks like a binary file, not text")
    try:
        return data.decode("utf-8-sig"), None
    except UnicodeDecodeError as exc:
        first_bad = exc.start
    text = data.decode("utf-8-sig", errors="replace")
    replaced = text.count("\ufffd")
    if replaced == sum(not c.isascii() for c in text) and (latin := _windows_1252(data)) is not None:
        return latin, f"{name} is not UTF-8; read it as Windows-1252 (Latin-1)"
    if replaced <= MAX_REPLACEMENT_SHARE * len(text):
        return text, None
    if _mostly_ascii_text(data):
        line = data.count(b"\n", 0, first_bad) + 1
        raise DocumentError(f"{name}: is not UTF-8 (byte 0x{data[first_bad]:02x} at line {line}, offset {first_bad});"
                            " convert it first, e.g. iconv -f ITS-ENCODING -t UTF-8")
    raise DocumentError(f"{name}: looks like a binary file, not text (it is not valid UTF-8)")


# Control characters a text file may hold; any other (ESC, BEL, DEL, …) in a non-UTF-8 file means binary.
_TEXT_CONTROLS = frozenset("\t\n\r\f\v")


def _windows_1252(data: bytes) -> str | None:
    try:
        text = data.decode("cp1252")
    except UnicodeDecodeError:  # one of the five bytes Windows-1252 leaves undefined
        return None
    controls = any((c < " " or c == "\x7f") and c not in _TEXT_CONTROLS for c in text)
    return None if controls else text


def _mostly_ascii_text(data: bytes, share: float = 0.9) -> bool:
    printable = sum(32 <= b < 127 or b in (9, 10, 13) for b in data)
    return printable >= share * len(data)


def _read_file(path: Path) -> bytes:
    name = str(path)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DocumentError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise DocumentError(f"{name}: is a directory, not a file") from None
    except PermissionError:
        raise DocumentError(f"{name}: permission denied") from None
    except OSError as exc:
        raise DocumentError(f"{name}: cannot read: {exc.strerror or exc}") from None


def _read_stdin() -> bytes:
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:
        raise DocumentError(f"{STDIN_NAME}: standard input is closed")
    try:
        return stream.read()
    except ValueError:  # "I/O operation on closed file"
        raise DocumentError(f"{STDIN_NAME}: standard input is closed") from None
    except OSError as exc:
        raise DocumentError(f"{STDIN_NAME}: cannot read: {exc.strerror or exc}") from None


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
