import hashlib
import io
import sys
from pathlib import Path

import pypdf
import pytest

from klevict_cli import documents
from klevict_cli.documents import Document, load_document, normalise
from klevict_cli.errors import DocumentError


def text_pdf(*pages: str) -> bytes:
    """A minimal hand-written PDF with one line of Helvetica text per page."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", "", "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for text in pages:
        stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET"
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream")
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {len(objects)} 0 R"
            " /Resources << /Font << /F1 3 0 R >> >> >>"
        )
        kids.append(f"{len(objects)} 0 R")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>"
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{offset:010d} 00000 n \n" for offset in offsets).encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def write(tmp_path: Path, name: str, data: bytes | str) -> str:
    path = tmp_path / name
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8", newline="")
    else:
        path.write_bytes(data)
    return str(path)


def encrypted(pdf: bytes, user_password: str, owner_password: str | None = None) -> bytes:
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(pdf)))
    writer.encrypt(user_password, owner_password)
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def error_of(source: str) -> str:
    with pytest.raises(DocumentError) as info:
        load_document(source)
    message = str(info.value)
    assert "\n" not in message
    return message


class FakeStdin:
    def __init__(self, data: bytes):
        self.buffer = io.BytesIO(data)


# --- text files ------------------------------------------------------------------------------------------------


def test_text_file_gives_text_name_and_hash(tmp_path):
    path = write(tmp_path, "doc.txt", "Hello  world.\r\n")
    doc = load_document(path)
    assert doc == Document(text="Hello world.", name=path, sha256=hashlib.sha256(b"Hello world.").hexdigest())


def test_a_piped_document_is_the_same_document_as_its_file(tmp_path, monkeypatch):
    """`cat f | klevict compress -` must record the same source hash as `klevict compress f`."""
    data = "caf\u00e9  au lait\r\n".encode()
    from_file = load_document(write(tmp_path, "doc.txt", data))
    monkeypatch.setattr(sys, "stdin", FakeStdin(data))
    piped = load_document("-")
    assert (piped.text, piped.sha256) == (from_file.text, from_file.sha256) and piped.name == "<stdin>"


def test_utf8_bom_is_stripped(tmp_path):
    assert load_document(write(tmp_path, "bom.txt", b"\xef\xbb\xbfcaf\xc3\xa9")).text == "café"


def test_utf16_with_bom_is_text(tmp_path):
    assert load_document(write(tmp_path, "win.txt", "Grüße\r\n".encode("utf-16"))).text == "Grüße"


def test_same_content_same_hash_across_line_endings_and_forms(tmp_path):
    a = load_document(write(tmp_path, "a.txt", "cafe\u0301\r\nbar  \r\n"))
    b = load_document(write(tmp_path, "b.md", "\ufeffcaf\u00e9\nbar"))
    assert a.text == b.text == "caf\u00e9\nbar"
    assert a.sha256 == b.sha256


def test_unknown_suffix_is_read_as_text(tmp_path):
    assert load_document(write(tmp_path, "notes", "plain")).text == "plain"


def test_nul_byte_means_binary(tmp_path):
    assert error_of(write(tmp_path, "a.bin", b"text\x00more")).endswith(
        ": looks like a binary file, not text (a NUL byte at offset 4)")


def test_a_cache_given_for_a_document_is_said_to_be_one(tmp_path):
    """`klevict summarize report.kvc` (meant ask): a cache, not "a binary file"."""
    path = write(tmp_path, "report.kvc", b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    assert error_of(path) == f"{path}: is a .kvc cache, not a document; ask it with klevict ask {path} QUESTION"


def test_bytes_all_outside_utf8_without_control_characters_are_not_utf8_text(tmp_path):
    # no control character: as likely text in an 8-bit encoding (KOI8-R, CP1251: nearly every byte high) as binary
    path = write(tmp_path, "img.txt", bytes(range(0x80, 0x100)) * 4)
    message = error_of(path)
    assert message.startswith(path) and "is not UTF-8 (byte 0x80 at line 1, offset 0; 512 of its 512 bytes" in message


def test_undecodable_bytes_among_control_characters_are_binary(tmp_path):
    path = write(tmp_path, "img.txt", bytes(range(0x01, 0x100)) * 4)
    message = error_of(path)
    assert message.startswith(path) and "looks like a binary file, not text" in message


def test_a_stray_invalid_byte_in_long_utf8_text_is_tolerated(tmp_path):
    data = "café ".encode() + b"word " * 200 + b"\xff" + b" end"  # UTF-8 (the é), 1 bad character in ~1000
    text = load_document(write(tmp_path, "damaged.txt", data)).text
    assert text.count("\ufffd") == 1 and text.endswith("\ufffd end") and text.startswith("café")


def test_just_over_one_percent_invalid_is_refused_saying_where(tmp_path):
    data = "café\n".encode() + b"a" * 92 + b"\xff\xff"  # UTF-8 with 2 bad of ~99 characters
    message = error_of(write(tmp_path, "x.txt", data))
    assert "is not UTF-8 (byte 0xff at line 2, offset 98; 2 of its 100 bytes are not UTF-8)" in message
    assert "iconv" in message


def test_one_bad_byte_is_counted_in_the_singular(tmp_path):
    data = b"Who is\x0bthere?\x0cWhat\x1chour?\x85end\n"  # controls: not Windows-1252; 1 bad byte is over 1 %
    assert "; 1 of its 29 bytes is not UTF-8)" in error_of(write(tmp_path, "q.txt", data))


@pytest.mark.parametrize("encoding", ["cp1252", "latin-1"])
def test_windows_1252_and_latin1_text_is_decoded(tmp_path, encoding):
    text = "Grüße aus Köln: café, crème brûlée, naïveté, 5 ½ £."
    if encoding == "cp1252":
        text += " “quoted” – 5 €"  # the characters Windows-1252 adds to Latin-1
    document = load_document(write(tmp_path, "old.txt", text.encode(encoding)))
    assert document.text == text
    (note,) = document.notes
    assert note.startswith(f"{tmp_path / 'old.txt'} is not UTF-8 (") and "0xfc at line 1, offset 2" in note
    assert note.endswith("read it as Windows-1252 (Latin-1), in which that byte is 'ü'")


def test_an_ascii_text_with_one_high_byte_is_windows_1252(tmp_path):
    document = load_document(write(tmp_path, "one.txt", b"word " * 200 + b"\xe9 end"))
    assert document.text.endswith("é end") and document.notes


def test_control_characters_are_not_windows_1252_text(tmp_path):
    assert "binary" in error_of(write(tmp_path, "x.bin", bytes([0x1B, 0x07, 0xE9, 0x7F, 0xC8]) * 50))


# --- normalisation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("e\u0301", "\u00e9"),  # NFC
        ("a \t  b\t\tc", "a b c"),  # runs of spaces and tabs
        ("a\r\nb\rc\nd", "a\nb\nc\nd"),  # line endings
        ("line one   \nline two\t\n", "line one\nline two"),  # trailing spaces
        ("p1\n\n\n\n\np2", "p1\n\np2"),  # paragraph breaks
        ("p1\n  \t \n \np2", "p1\n\np2"),  # blank lines holding only spaces
        ("p1\r\n\r\np2", "p1\n\np2"),
        ("  \n\n text \n\n ", "text"),  # document edges
        ("page1\fpage2", "page1\n\npage2"),  # form feed is a page break
        ("  indented", "indented"),
        ("a\n  b", "a\n b"),  # leading spaces of a line collapse but are kept
    ],
)
def test_normalise(raw, expected):
    assert normalise(raw) == expected


@pytest.mark.parametrize("raw", ["one\ntwo", "one\r\ntwo", "one\rtwo", "one\ttwo", "one \n two", "one\n\n\n\ntwo"])
def test_words_are_never_joined(raw):
    assert normalise(raw).split() == ["one", "two"]


def test_normalised_text_is_a_fixed_point():
    once = normalise("  A \u0301 b\r\n\r\n\r\nc \t d\n")
    assert normalise(once) == once


# --- file errors -----------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.txt")
    assert error_of(path) == f"{path}: no such file"


def test_directory(tmp_path):
    assert "is a directory" in error_of(str(tmp_path))


def test_permission_denied(tmp_path, monkeypatch):
    path = write(tmp_path, "secret.txt", "x")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(documents, "open", refuse, raising=False)
    assert error_of(path) == f"{path}: permission denied"


@pytest.mark.parametrize("content", [b"", b"   \n\t\r\n  ", b"\r\n\r\n"])
def test_empty_or_whitespace_only_file(tmp_path, content):
    path = write(tmp_path, "empty.txt", content)
    message = error_of(path)
    assert message.startswith(f"{path}: is empty")


# --- PDF -------------------------------------------------------------------------------------------------------


def test_pdf_text_layer_pages_joined_by_blank_line(tmp_path):
    path = write(tmp_path, "doc.pdf", text_pdf("Hello world", "Second page"))
    assert load_document(path).text == "Hello world\n\nSecond page"


def test_pdf_suffix_is_case_insensitive(tmp_path):
    assert load_document(write(tmp_path, "DOC.PDF", text_pdf("Upper"))).text == "Upper"


def test_pdf_is_detected_by_content(tmp_path):
    assert load_document(write(tmp_path, "download", text_pdf("Sniffed"))).text == "Sniffed"


def test_pdf_without_text_layer(tmp_path):
    writer = pypdf.PdfWriter()
    writer.add_blank_page(width=612, height=792)
    buffer = io.BytesIO()
    writer.write(buffer)
    path = write(tmp_path, "scan.pdf", buffer.getvalue())
    assert error_of(path) == f"{path}: has no text layer (scanned?); run OCR first"


def test_pdf_with_password_is_refused(tmp_path):
    path = write(tmp_path, "locked.pdf", encrypted(text_pdf("Secret"), "pw"))
    message = error_of(path)
    assert message.startswith(path) and "encrypted" in message


def test_pdf_encrypted_with_empty_user_password_opens(tmp_path):
    path = write(tmp_path, "permissions.pdf", encrypted(text_pdf("Readable"), "", "owner"))
    assert load_document(path).text == "Readable"


@pytest.mark.parametrize(
    "data",
    [b"%PDF-1.4\nthis is not really a pdf", b"not a pdf at all", text_pdf("Truncated")[:60]],
)
def test_broken_pdf(tmp_path, data):
    path = write(tmp_path, "broken.pdf", data)
    assert error_of(path).startswith(f"{path}: cannot read PDF: ")


def test_empty_pdf_file_is_empty(tmp_path):
    path = write(tmp_path, "zero.pdf", b"")
    assert error_of(path) == f"{path}: is empty"


# --- stdin -----------------------------------------------------------------------------------------------------


def test_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", FakeStdin("from  a pipe\r\n".encode()))
    doc = load_document("-")
    assert (doc.text, doc.name) == ("from a pipe", "<stdin>")


def test_stdin_pdf_is_detected_by_content(monkeypatch):
    monkeypatch.setattr(sys, "stdin", FakeStdin(text_pdf("Piped PDF")))
    assert load_document("-").text == "Piped PDF"


def test_stdin_empty(monkeypatch):
    monkeypatch.setattr(sys, "stdin", FakeStdin(b""))
    assert error_of("-").startswith("<stdin>: is empty")


def test_stdin_whitespace_only(monkeypatch):
    monkeypatch.setattr(sys, "stdin", FakeStdin(b"\n \n"))
    assert error_of("-").startswith("<stdin>: is empty")


def test_stdin_closed(monkeypatch):
    fake = FakeStdin(b"data")
    fake.buffer.close()
    monkeypatch.setattr(sys, "stdin", fake)
    assert error_of("-") == "<stdin>: standard input is closed"


def test_stdin_missing(monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)
    assert error_of("-") == "<stdin>: standard input is closed"


def test_stdin_binary(monkeypatch):
    monkeypatch.setattr(sys, "stdin", FakeStdin(b"\x00\x01\x02"))
    assert error_of("-") == "<stdin>: looks like a binary file, not text (a NUL byte at offset 0)"


def test_broken_pdf_warnings_stay_off_the_log(tmp_path, caplog):
    path = write(tmp_path, "not-a.pdf", b"not a pdf at all")
    assert "invalid pdf header" in error_of(path)  # pypdf's first warning is kept as the hint
    assert not [record for record in caplog.records if record.name.startswith("pypdf")]
