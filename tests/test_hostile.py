"""Hostile input (issue 42): huge files, pipes that stop early, outputs that are not plain files, forged caches.

The slow parts are subprocesses of the real command line (to measure its memory and its exit code on a real pipe);
none loads a model.
"""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from klevict_cli import batch, documents
from klevict_cli.documents import load_document
from klevict_cli.errors import DocumentError

REPO = Path(__file__).resolve().parents[1]


def klevict(*args: str, stdin=None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "klevict_cli", *args], capture_output=True, stdin=stdin,
                          timeout=timeout, env=env, cwd=REPO)


def sparse(path: Path, size: int, head: bytes = b"") -> Path:
    path.write_bytes(head)
    os.truncate(path, size)
    return path


# ---- 1. huge files are refused from a bounded prefix ------------------------------------------------------------
MEASURE = textwrap.dedent("""
    import json, resource, subprocess, sys, time
    start = time.perf_counter()
    done = subprocess.run(sys.argv[1:], capture_output=True)
    print(json.dumps({"seconds": time.perf_counter() - start, "rc": done.returncode,
                      "stderr": done.stderr.decode(errors="replace"),
                      "peak_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
""")


def test_a_5_gb_sparse_file_is_refused_in_under_2_s_within_500_mb(tmp_path):
    big = sparse(tmp_path / "big.txt", 5 * 2**30)
    # measured by a parent of its own, so that RUSAGE_CHILDREN's peak is this command's alone
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-m", "klevict_cli", "compress", str(big),
                           "-o", str(tmp_path / "x.kvc")], capture_output=True, text=True, env=env, timeout=120)
    run = json.loads(done.stdout)
    assert run["rc"] == 3, run
    assert run["stderr"].strip() == f"error: {big}: looks like a binary file, not text (a NUL byte at offset 0)"
    assert run["seconds"] < 2, run
    assert run["peak_kib"] < 500 * 1024, run
    assert not (tmp_path / "x.kvc").exists()


def test_text_followed_by_a_hole_is_refused_where_the_nul_bytes_begin(tmp_path):
    # 140 kB of text, then NULs, under the size limit (a larger one is refused as too large after its first bytes)
    big = sparse(tmp_path / "big.txt", 900 * 2**20, b"A real start.\n" * 10_000)
    start = time.perf_counter()
    with pytest.raises(DocumentError, match=r"binary file, not text \(a NUL byte at offset 140000\)"):
        load_document(str(big))
    assert time.perf_counter() - start < 2


def test_a_batch_hashes_and_refuses_a_huge_binary_file_without_reading_it(tmp_path):
    big = sparse(tmp_path / "big.txt", 5 * 2**30)
    good = tmp_path / "good.txt"
    good.write_text("fine text")
    start = time.perf_counter()
    sources = batch.plan_sources([str(big), str(good)], None)
    assert time.perf_counter() - start < 2
    assert "binary" in str(sources[0].error) and sources[0].sha256 is None
    assert sources[1].error is None and sources[1].sha256 == documents.hashlib.sha256(b"fine text").hexdigest()
    with pytest.raises(DocumentError, match="binary"):
        documents.read_source(str(big))


def test_text_over_the_size_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "MAX_DOCUMENT_BYTES", 200_000)
    path = tmp_path / "long.txt"
    path.write_bytes(b"word " * 100_000)  # 500 kB of text
    reads = []
    real_read = documents._read_fully
    monkeypatch.setattr(documents, "_read_fully", lambda stream, want: reads.append(want) or real_read(stream, want))
    with pytest.raises(DocumentError, match=r"long.txt: is too large \(0.00 GiB\); klevict reads documents of at most"):
        load_document(str(path))
    assert reads == [documents.SNIFF]  # the first bytes only: enough to call a binary file binary
    with pytest.raises(DocumentError, match="is too large"):
        documents.source_sha256(str(path))


def test_a_pipe_over_the_size_limit_is_refused_once_it_has_given_that_much(monkeypatch):
    monkeypatch.setattr(documents, "MAX_DOCUMENT_BYTES", 3 * documents.CHUNK)

    class Endless:
        def read(self, n):
            return b"a" * n

    monkeypatch.setattr(sys, "stdin", type("In", (), {"buffer": Endless()})())
    with pytest.raises(DocumentError, match=r"<stdin>: is too large; klevict reads documents of at most"):
        load_document("-")


def test_text_is_decoded_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "SNIFF", 7)
    monkeypatch.setattr(documents, "CHUNK", 5)
    text = "Grüße, 東京 — naïve café\n" * 3
    path = tmp_path / "u.txt"
    path.write_text(text, encoding="utf-8")
    assert load_document(str(path)).text == documents.normalise(text)
    path.write_bytes(b"\xff\xfe" + text.encode("utf-16-le"))
    assert load_document(str(path)).text == documents.normalise(text)


# ---- 4. decoding: say what the bytes are -------------------------------------------------------------------------
def test_utf8_text_with_one_bad_byte_is_read_with_a_note_not_called_binary(tmp_path):
    path = tmp_path / "jp.txt"
    path.write_bytes("東京の天気は晴れです。".encode() + b"\xff" + "明日も晴れ。".encode())  # 1 bad byte in 18 characters
    document = load_document(str(path))
    assert document.text == "東京の天気は晴れです。\ufffd明日も晴れ。"
    assert document.notes == (f"{path}: 1 byte is not valid UTF-8 (the first, byte 0xff at line 1, offset 33);"
                              " read as U+FFFD (\ufffd)",)


def test_ascii_with_a_byte_windows_1252_lacks_is_read_with_a_note_not_silently(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"word " * 300 + b"\x81 end")  # 0x81: undefined in Windows-1252, so not that either
    document = load_document(str(path))
    assert document.text.endswith("\ufffd end")
    assert document.notes == (f"{path}: 1 byte is not valid UTF-8 (the first, byte 0x81 at line 1, offset 1500);"
                              " read as U+FFFD (\ufffd)",)


def test_ascii_with_a_few_high_bytes_says_how_many_and_where_it_read_windows_1252(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"line one\ncaf\xe9 and na\xefve\n")
    document = load_document(str(path))
    assert document.text == "line one\ncafé and naïve"
    assert document.notes == (f"{path} is not UTF-8 (2 non-ASCII bytes, the first byte 0xe9 at line 2, offset 12);"
                              " read it as Windows-1252 (Latin-1), in which that byte is 'é'",)


@pytest.mark.parametrize(("encoding", "order"), [("utf-16-le", "little-endian"), ("utf-16-be", "big-endian")])
def test_utf16_without_a_bom_is_read_with_a_note(tmp_path, encoding, order):
    path = tmp_path / "w.txt"
    path.write_bytes("Grüße aus Köln.\r\nZweite Zeile – mit “Anführung”.".encode(encoding))
    document = load_document(str(path))
    assert document.text == "Grüße aus Köln.\nZweite Zeile – mit “Anführung”."
    assert document.notes == (f"{path} has no byte order mark but every other byte is NUL; read it as UTF-16"
                              f" {order}",)


def test_utf16_without_a_bom_that_does_not_decode_is_refused_as_utf16(tmp_path):
    path = tmp_path / "w.txt"
    path.write_bytes("ab".encode("utf-16-le") + b"\x01\xd8" + "cd".encode("utf-16-le"))  # a lone high surrogate
    with pytest.raises(DocumentError, match=r"is not valid UTF-16 \(little-endian, assumed from its NUL bytes\)"):
        load_document(str(path))


def test_text_in_an_encoding_klevict_does_not_read_is_not_called_binary(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes("Привет, мир. ".encode("koi8-r") * 3 + "ещё".encode() + b"\x81")  # UTF-8 and KOI8-R mixed
    with pytest.raises(DocumentError) as info:
        load_document(str(path))
    assert "binary" not in str(info.value) and "is not UTF-8 (byte 0xf0 at line 1, offset 0;" in str(info.value)


def test_inspect_decodes_a_character_split_across_tokens_as_one_piece(tokenizer):
    from klevict_cli.display import decode_spans

    ids = tokenizer.encode("東京 ok é", add_special_tokens=False)
    assert "\ufffd" in tokenizer.decode(ids[:1])  # the tiny tokenizer splits these characters into byte tokens
    pieces = decode_spans(tokenizer, ids)
    assert [text for text, _ in pieces] == ["東", "京", " ", "o", "k", " ", "é"]
    assert [len(span) for _, span in pieces] == [3, 3, 1, 1, 1, 1, 2]
    assert [i for _, span in pieces for i in span] == list(range(len(ids)))


# ---- 2. a reader that stops early is exit 7, never success ---------------------------------------------------------
class PipeStdout:
    """sys.stdout on the write end of a real pipe, read by a thread that takes `keep` bytes and closes its end."""

    def __init__(self, keep: int):
        import threading

        read_fd, write_fd = os.pipe()
        self.buffer = os.fdopen(write_fd, "wb")
        self.got = b""

        def reader():
            with os.fdopen(read_fd, "rb", buffering=0) as pipe:
                while len(self.got) < keep and (piece := pipe.read(keep - len(self.got))):
                    self.got += piece

        self.thread = threading.Thread(target=reader)
        self.thread.start()


def test_a_cache_written_to_a_pipe_whose_reader_stops_early_is_an_output_error(monkeypatch):
    from klevict_cli.errors import OutputError
    from klevict_cli.files import write_stdout

    pipe = PipeStdout(keep=1000)
    monkeypatch.setattr(sys, "stdout", pipe)
    with pytest.raises(OutputError, match=r"<stdout>: cannot write the cache \(Broken pipe\); [\d,]+ of its"
                                          r" 3,000,000 bytes were written"):
        write_stdout(b"k" * 3_000_000)  # far more than a pipe holds, so the reader's exit is seen mid-write
    pipe.thread.join()
    assert pipe.got == b"k" * 1000


def test_compress_to_a_reader_that_stops_early_exits_7(tiny_model_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("Call me Ishmael. Some years ago, never mind how long precisely, I went to sea. " * 12)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "klevict_cli", "compress", str(doc), "-o", "-", "--method",
                                "none", "--model", str(tiny_model_dir)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env)
    head = process.stdout.read(1000)  # like `| head -c 1000`: take the start and go
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 7, stderr
    assert len(head) == 1000
    assert stderr.startswith("error: <stdout>: cannot write the cache (Broken pipe); ") and stderr.count("\n") == 1
    assert "wrote <stdout>" not in stderr


def test_a_result_to_a_closed_pipe_is_exit_7_not_a_traceback(capsys):
    import typer

    from klevict_cli.cli import handle_errors

    @handle_errors
    def answer():
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(typer.Exit) as info:
        answer()
    assert info.value.exit_code == 7
    assert capsys.readouterr().err == "error: <stdout>: the reader closed it before the whole output was written\n"


class FailingStream(io.StringIO):
    """A text stream whose writes fail as a full disk's (ENOSPC) or a closed pipe's (EPIPE) do."""

    def __init__(self, code: int):
        super().__init__()
        self.code = code

    def write(self, text):
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize(("code", "message"), [
    (errno.ENOSPC, "<stdout>: cannot write the output (No space left on device)"),
    (errno.EPIPE, "<stdout>: the reader closed it before the whole output was written"),
])
def test_a_result_that_stdout_cannot_take_is_an_output_error(monkeypatch, code, message):
    """Any failed write to standard output — a full disk behind a redirect, a reader gone — is the documented exit 7
    with one line, through rich's console too (rich ends a broken pipe with a silent exit 1 of its own)."""
    from rich.console import Console

    from klevict_cli.errors import OutputError
    from klevict_cli.files import GuardedStdout

    monkeypatch.setattr("klevict_cli.files.silence_stdout", lambda: None)  # the test's stdout is not the stream
    guarded = GuardedStdout(FailingStream(code))
    assert guarded.write("") == 0  # click probes a stream with an empty write
    with pytest.raises(OutputError) as info:
        guarded.write("The sea.\n")
    assert str(info.value) == message
    with pytest.raises(OutputError) as info:
        Console(file=guarded).print("a table")
    assert str(info.value) == message


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_help_and_version_to_a_full_disk_exit_7():
    for args in (["--version"], ["--help"]):
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, "-m", "klevict_cli", *args], stdout=full, stderr=subprocess.PIPE,
                                  env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, timeout=120, text=True)
        assert done.returncode == 7, done.stderr
        assert done.stderr == "error: <stdout>: cannot write the output (No space left on device)\n"


def test_inspect_text_and_html_show_characters_split_across_tokens(tiny_model_dir, tmp_path):
    from .test_cli import assert_ok, invoke

    doc, kvc, page = tmp_path / "doc.txt", tmp_path / "doc.kvc", tmp_path / "doc.html"
    doc.write_text("The harbour of 東京 counted 17 ships; the café wrote it down. " * 3, encoding="utf-8")
    model = str(tiny_model_dir)
    assert_ok(invoke("compress", doc, "-o", kvc, "--model", model, "--method", "none", "--chunk-size", "64"))
    shown = invoke("inspect", kvc, "--text", "--html", page, "--model", model)
    assert_ok(shown)
    assert "東京" in shown.stdout and "café" in shown.stdout and "\ufffd" not in shown.stdout
    html = page.read_text(encoding="utf-8")
    assert "東" in html and "é" in html and "\ufffd" not in html


# ---- 5. outputs: one rule for each kind of path ------------------------------------------------------------------
def test_a_symlink_output_writes_the_file_it_points_to_and_stays_a_link(tmp_path):
    from klevict_cli.files import check_destination, write_atomically

    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "doc.kvc"
    target.write_bytes(b"old")
    link = tmp_path / "link.kvc"
    link.symlink_to(target)
    check_destination(link, "-o")
    write_atomically(link, b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.kvc", "real"]  # no temp file left beside the link
    dangling = tmp_path / "next.kvc"
    dangling.symlink_to(tmp_path / "real" / "new.kvc")  # a link to a file not written yet: the file is created
    write_atomically(dangling, b"first")
    assert dangling.is_symlink() and (tmp_path / "real" / "new.kvc").read_bytes() == b"first"


def test_a_symlink_to_a_missing_folder_or_a_fifo_is_refused_as_unwritable(tmp_path):
    from klevict_cli.errors import OutputError
    from klevict_cli.files import check_destination

    (tmp_path / "away.kvc").symlink_to(tmp_path / "missing" / "x.kvc")
    with pytest.raises(OutputError, match="the folder .*missing does not exist"):
        check_destination(tmp_path / "away.kvc", "-o")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo.kvc").symlink_to(tmp_path / "fifo")
    for path in (tmp_path / "fifo", tmp_path / "to-fifo.kvc"):
        with pytest.raises(OutputError, match="cannot write it: not a regular file"):  # exit 7, as the README says
            check_destination(path, "-o")


def test_no_output_replaces_the_input_it_was_made_from(tiny_model_dir, tmp_path):
    from klevict_cli.errors import UsageError
    from klevict_cli.files import check_destination

    from .test_cli import assert_error, assert_ok, invoke

    doc, kvc = tmp_path / "doc.txt", tmp_path / "doc.kvc"
    doc.write_text("The harbour master counted 17 ships on Monday and 23 on Friday. " * 4, encoding="utf-8")
    assert_ok(invoke("compress", doc, "-o", kvc, "--model", str(tiny_model_dir), "--method", "none"))
    cache = kvc.read_bytes()
    assert_error(invoke("inspect", kvc, "--html", kvc), 2, "--html")
    assert kvc.read_bytes() == cache
    (tmp_path / "link.kvc").symlink_to(kvc)  # another name for the same file
    for flag, inputs in (("--html", [tmp_path / "link.kvc"]), ("--out", ["-", doc, kvc])):
        with pytest.raises(UsageError, match="is the input"):
            check_destination(kvc, flag, inputs=inputs)
    check_destination(tmp_path / "new.kvc", "-o", inputs=[doc])  # a path not yet written is no input


def test_missing_folders_are_never_created_for_a_file_or_above_a_batch_outdir(tmp_path):
    from klevict_cli.errors import OutputError
    from klevict_cli.files import check_destination

    with pytest.raises(OutputError, match="the folder .*missing does not exist"):
        check_destination(tmp_path / "missing" / "x.kvc", "-o")
    with pytest.raises(OutputError, match=r"the folder .*missing does not exist \(klevict creates OUTDIR but no"):
        batch.prepare_folder(tmp_path / "missing" / "sub")
    assert not (tmp_path / "missing").exists()
    batch.prepare_folder(tmp_path / "out")  # OUTDIR itself is created
    assert (tmp_path / "out").is_dir()


# ---- 3. budgets: one reading for each string, and counts that say what they count ----------------------------------
@pytest.mark.parametrize("text", ["١٠%", "٠.٥", "۲k", "１０", "2\u0663"])  # Arabic-Indic, Persian, full-width digits
def test_only_ascii_digits_make_a_budget(text):
    from klevict_cli.errors import UsageError
    from klevict_cli.options import parse_budget

    with pytest.raises(UsageError, match="invalid --budget"):
        parse_budget(text)


def test_other_scripts_digits_are_refused_in_every_number_option():
    from klevict_cli.errors import UsageError
    from klevict_cli.options import parse_size, parse_working_limit

    for call in (lambda: parse_working_limit("٤x"), lambda: parse_size("max_memory", "٤G"),
                 lambda: batch.parse_shard("١/٢")):
        with pytest.raises(UsageError):
            call()


def test_an_integer_is_a_count_and_a_share_needs_a_point_or_percent_as_the_error_says():
    from klevict_cli.errors import UsageError
    from klevict_cli.options import Budget, parse_budget

    assert parse_budget("1") == Budget(tokens=1) and parse_budget("1.0") == Budget(fraction=1.0)
    with pytest.raises(UsageError) as info:
        parse_budget("1.5")
    message = str(info.value)
    assert "(a number with a decimal point is a share of the tokens and must be in (0, 1])" in message
    assert "written with % or a decimal point" in message and "a whole number of entries per KV head" in message
    assert "fraction" not in message


def test_compress_and_inspect_say_the_budget_counts_the_chat_frame(tiny_model_dir, tmp_path):
    import math

    from .test_cli import assert_ok, invoke

    doc, kvc = tmp_path / "doc.txt", tmp_path / "doc.kvc"
    doc.write_text("The harbour master counted 17 ships on Monday and 23 on Friday. " * 4, encoding="utf-8")
    model = str(tiny_model_dir)
    made = invoke("compress", doc, "-o", kvc, "--model", model, "--budget", "10%", "--json", "--no-reconstruct")
    assert_ok(made)
    summary = json.loads(made.stdout)
    frame, tokens = summary["prefix_tokens"], summary["document"]["tokens"]
    assert frame > 0 and summary["budget_tokens"] == math.ceil(0.1 * (tokens + frame))  # what the README says
    plain = invoke("compress", doc, "-o", kvc, "--model", model, "--budget", "10%", "--no-reconstruct")
    assert f"{tokens} document tokens + {frame} of the chat frame -> {summary['budget_tokens']} entries per head" \
        in plain.stdout
    shown = invoke("inspect", kvc)
    assert_ok(shown)
    text = " ".join(shown.stdout.replace("│", " ").split())  # the table's cells, unwrapped
    assert f"prefix_tokens {frame}" in text and f"document_tokens {tokens}" in text
    assert f"of {tokens + frame} streamed tokens ({frame} of the chat frame, then the document's)" in text


# ---- 8. help and messages --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("command", "shown"), [("compress", "FILE..."), ("ask", "CACHE..."), ("ask", "QUESTION"),
                                                ("inspect", "CACHE"), ("summarize", "FILE"), ("bench", "FILE")])
def test_help_names_arguments_without_python_type_names(command, shown):
    from .test_cli import assert_ok, invoke

    result = invoke(command, "--help")
    assert_ok(result)
    arguments = result.stdout.split("Arguments:")[1].split("Options:")[0]
    assert f"  {shown}  " in arguments
    assert "<list[" not in result.stdout and "<str>" not in arguments and "<path>" not in arguments


@pytest.mark.parametrize(("wrong", "using", "needle"), [
    ("model_weights_sha256", "m", "made by model m, and its weights have changed since then (another version of"),
    ("model_config_sha256", "m", "made by model m, and its architecture (config) has changed since then"),
    ("model_config_sha256", "other", "made by model m, whose architecture (config) differs from the model you"),
    ("model_weights_sha256", "other", "made by model m, whose weights differ from the model you are using"),
])
def test_a_cache_from_another_model_is_refused_in_grammatical_english(wrong, using, needle):
    from klevict_cli import kvc
    from klevict_cli.errors import CacheFileError

    metadata = {"model_id": "m", "model_config_sha256": "a", "model_weights_sha256": "b"}
    with pytest.raises(CacheFileError) as info:
        kvc._check_expected(Path("x.kvc"), metadata, {**metadata, wrong: "changed"}, using)
    assert needle in str(info.value)


def test_a_read_whose_outputs_overflow_is_refused_with_the_dtype_to_use():
    """A model whose activations exceed float16's range (Gemma-3-270M read with --dtype float16) gives non-finite
    logits: the read stops with one clear error (exit 5) naming the dtypes that work, not a crash in sampling."""
    import torch

    from klevict_cli.adapter_check import adapter_for
    from klevict_cli.engine import Engine
    from klevict_cli.errors import ModelError
    from klevict_cli.policies import make_policy
    from tests.conftest import tiny_llama

    model = tiny_llama(seed=2).half()
    with torch.no_grad():  # finite weights (at most ~86) whose MLP outputs pass float16's 65,504
        for layer in model.model.layers:
            for projection in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                projection.weight.mul_(1000)
    engine = Engine(model, adapter_for(model), make_policy("kl"), 16, chunk_size=32)
    with pytest.raises(ModelError, match="float16's range.*--dtype bfloat16 or float32") as caught:
        engine.feed(engine.new_stream(), list(range(3, 90)))
    assert caught.value.exit_code == 5
