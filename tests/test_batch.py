"""Batch compression and questions across caches, through the CLI on a tiny in-process model.

The contract: one `.kvc` per document in OUTDIR/ and one manifest line each; a bad document is recorded and the
batch goes on (exit 8); a re-run skips what is done; `--shard i/n` splits by source hash whatever the argument
order; `ask OUTDIR/` answers from every cache with one model load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from klevict_cli import batch, cli, reading
from klevict_cli.batch import EXIT_SOME_FAILED, MANIFEST, in_shard, kvc_names, parse_shard
from klevict_cli.errors import UsageError

from .test_cli import DOC_TEXT, FAST, GEN, _no_crash, _show, assert_error, assert_ok, invoke, no_temp_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAST_BATCH = ["--budget", "48", *FAST, "--no-reconstruct"]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir)


@pytest.fixture
def corpus(tmp_path) -> Path:
    """Four small documents, two of them with the same file name in different folders."""
    root = tmp_path / "corpus"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    paragraphs = DOC_TEXT.split("\n\n")
    for i, text in enumerate(paragraphs):
        (root / f"doc{i}.txt").write_text(text, encoding="utf-8")
    (root / "a" / "report.md").write_text(paragraphs[0] + " Alpha.", encoding="utf-8")
    (root / "b" / "report.md").write_text(paragraphs[1] + " Beta.", encoding="utf-8")
    return root


def manifest(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / MANIFEST).read_text(encoding="utf-8").splitlines()]


def tensors_of(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


# ---- pure helpers ----------------------------------------------------------------------------------------------
def test_shard_parsing_and_membership():
    assert parse_shard("1/4") == (1, 4) and parse_shard(None) is None
    for bad in ("4/4", "1", "a/b", "-1/2", "0/0"):
        with pytest.raises(UsageError):
            parse_shard(bad)
    keys = [f"{i:064x}" for i in range(0, 2**20, 9973)]
    for n in (1, 3):
        owners = [[i for i in range(n) if in_shard(k, (i, n))] for k in keys]
        assert all(len(o) == 1 for o in owners)  # every document in exactly one shard


def test_names_are_stable_and_collisions_get_a_path_hash():
    names = kvc_names(["x/report.md", "y/Report.txt", "z/notes.pdf", "odd name!.txt"])
    assert names["z/notes.pdf"] == "notes.kvc" and names["odd name!.txt"] == "odd_name.kvc"
    assert names["x/report.md"] != names["y/Report.txt"]
    assert names["x/report.md"].startswith("report-") and names["x/report.md"].endswith(".kvc")
    assert kvc_names(["y/Report.txt", "x/report.md"]) == {k: v for k, v in names.items() if "report" in k.lower()}


def test_names_keep_letters_of_any_script():
    decomposed = "cafe\u0301.md"  # é as e + a combining accent, as macOS writes file names
    names = kvc_names(["Крейцерова соната.txt", decomposed, "東京/報告.pdf", "\x07bell.txt"])
    assert names["Крейцерова соната.txt"] == "Крейцерова_соната.kvc"
    assert names[decomposed] == "caf\u00e9.kvc" and names["東京/報告.pdf"] == "報告.kvc"
    assert names["\x07bell.txt"] == "bell.kvc"  # control characters are not kept
    assert kvc_names(["हिन्दी.txt"]) == {"हिन्दी.txt": "हिन्दी.kvc"}  # combining vowel signs are part of the word
    final, medial = kvc_names(["x/ς.txt", "y/Σ.txt"]).values()  # one name to a file system blind to case
    assert final != medial and final.startswith("ς-") and medial.startswith("Σ-")


def test_a_name_an_earlier_run_gave_stays_with_its_source():
    owners = {"report.kvc": os.path.normpath("x/report.md"), "notes-0a1b2c3d.kvc": os.path.normpath("z/notes.pdf")}
    names = kvc_names(["y/Report.txt", "z/notes.pdf", "x/report.md"], owners)
    assert names["x/report.md"] == "report.kvc"  # its own, though y/Report.txt collides with it in this run
    assert names["z/notes.pdf"] == "notes-0a1b2c3d.kvc"  # the name it was given, hashed or not
    assert names["y/Report.txt"].startswith("Report-")
    alone = kvc_names(["y/Report.txt"], owners)  # another run, alone: the name is someone else's
    assert alone == {"y/Report.txt": names["y/Report.txt"]}


def test_a_kvc_no_batch_wrote_holds_its_name():
    """A `.kvc` in OUTDIR that no batch wrote (owner None) is a name taken, as one another source owns is."""
    names = kvc_names(["y/report.txt", "notes.md"], {"report.kvc": None})
    assert names["y/report.txt"] == kvc_names(["x/report.md", "y/report.txt"])["y/report.txt"] != "report.kvc"
    assert names["notes.md"] == "notes.kvc"


# ---- compress many -------------------------------------------------------------------------------------------
def test_runs_into_one_folder_never_write_over_each_others_caches(corpus, model, tmp_path):
    """Two runs whose documents share a file name: the second gets a name of its own, and a run of both later
    writes no third cache (each keeps the name it was given)."""
    out = tmp_path / "out"
    for doc in ("a", "b", "a"):
        assert_ok(invoke("compress", corpus / doc / "report.md", "-o", f"{out}/", "--model", model, *FAST_BATCH))
    both = invoke("compress", corpus / "a" / "report.md", corpus / "b" / "report.md", "-o", f"{out}/", "--model",
                  model, *FAST_BATCH, "--json")
    assert [json.loads(line)["status"] for line in both.stdout.splitlines()] == ["skipped", "skipped"]
    caches = {p.name for p in out.glob("*.kvc")}
    (other,) = caches - {"report.kvc"}
    assert "report.kvc" in caches and other.startswith("report-")
    sources = {r["kvc"]: r["source"] for r in manifest(out)}
    assert sources == {"report.kvc": str(corpus / "a" / "report.md"), other: str(corpus / "b" / "report.md")}


def test_a_batch_never_writes_over_a_kvc_it_did_not_write(corpus, model, tmp_path):
    """A cache that `compress FILE -o OUTDIR/NAME.kvc` wrote is no batch's: the batch's document takes a name of
    its own, and a re-run finds its own cache again."""
    out = tmp_path / "out"
    out.mkdir()
    assert_ok(invoke("compress", corpus / "a" / "report.md", "-o", out / "report.kvc", "--model", model,
                     *FAST_BATCH))
    theirs = (out / "report.kvc").read_bytes()
    args = ["compress", corpus / "b" / "report.md", "-o", f"{out}/", "--model", model, *FAST_BATCH, "--json"]
    first = invoke(*args)
    assert_ok(first)
    (record,) = map(json.loads, first.stdout.splitlines())
    assert record["status"] == "ok" and record["kvc"].startswith("report-")
    assert (out / "report.kvc").read_bytes() == theirs
    again = invoke(*args)
    assert [json.loads(line)["status"] for line in again.stdout.splitlines()] == ["skipped"]
    assert sorted(p.name for p in out.glob("*.kvc")) == sorted(["report.kvc", record["kvc"]])


def test_batch_writes_one_kvc_per_document_and_a_manifest(corpus, model, tmp_path):
    out = tmp_path / "out"
    result = invoke("compress", corpus, "-o", f"{out}/", "--model", model, *FAST_BATCH, "--json")
    assert_ok(result)
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 5 and all(r["status"] == "ok" for r in records)
    lines = manifest(out)
    assert [r["source"] for r in lines] == [r["source"] for r in records]
    assert sorted(p.name for p in out.glob("*.kvc")) == sorted(r["kvc"] for r in lines)
    for r in lines:
        assert r["bytes"] == (out / r["kvc"]).stat().st_size and r["document_tokens"] > 0 and r["kept_entries"] > 0
        # the file's bytes, under the name the .kvc gives them (its `source_sha256` is the text's)
        assert r["source_file_sha256"] == hashlib.sha256(Path(r["source"]).read_bytes()).hexdigest()
        assert "source_sha256" not in r
    assert no_temp_files(out) == []
    assert "5 compressed, 0 already done, 0 failed" in result.stderr


def test_a_batch_records_each_caches_drift_and_redoes_it_when_asked_to_measure(corpus, model, tmp_path):
    """The drift is in the manifest and on the plain line where measured (these notes are too short for the
    default to measure it); --estimate is part of what a re-run compares, so asking for it redoes the documents."""
    out = tmp_path / "out"
    args = ["compress", corpus / "doc0.txt", corpus / "doc1.txt", "-o", out, "--model", model, *FAST_BATCH]
    plain = invoke(*args)
    assert_ok(plain)
    assert "drift" not in plain.stdout and all(r["estimated_kl"] is None for r in manifest(out))
    measured = invoke(*args, "--estimate")
    assert_ok(measured)
    assert measured.stdout.count("; estimated drift ") == 2
    records = manifest(out)[2:]
    assert len(records) == 2 and all(r["status"] == "ok" and r["estimated_kl"]["kl"] > 0 for r in records)
    again = invoke(*args, "--estimate", "--json")
    assert [json.loads(line)["status"] for line in again.stdout.splitlines()] == ["skipped", "skipped"]


def test_a_bad_document_is_recorded_and_the_batch_goes_on(corpus, model, tmp_path):
    (corpus / "binary.txt").write_bytes(b"\x00\x01\x02" * 50)
    out = tmp_path / "out"
    result = invoke("compress", corpus / "binary.txt", corpus / "doc0.txt", corpus / "missing.txt", "-o", out,
                    "--model", model, *FAST_BATCH)
    _no_crash(result)
    assert result.exit_code == EXIT_SOME_FAILED, _show(result)
    status = {Path(r["source"]).name: r for r in manifest(out)}
    assert status["doc0.txt"]["status"] == "ok"
    assert status["binary.txt"]["status"] == "failed" and status["binary.txt"]["error"] == "DocumentError"
    assert "binary" in status["binary.txt"]["message"]
    assert status["missing.txt"]["status"] == "failed" and "no such file" in status["missing.txt"]["message"]
    assert sorted(p.name for p in out.glob("*.kvc")) == ["doc0.kvc"]
    assert "1 compressed, 0 already done, 2 failed" in result.stdout


def test_rerun_skips_what_is_done_and_redoes_what_changed(corpus, model, tmp_path):
    out = tmp_path / "out"
    args = ["compress", corpus / "doc0.txt", corpus / "doc1.txt", "-o", out, "--model", model, *FAST_BATCH]
    assert_ok(invoke(*args))
    first = {p.name: p.stat().st_mtime_ns for p in out.glob("*.kvc")}
    again = invoke(*args, "--json")
    assert_ok(again)
    assert [json.loads(line)["status"] for line in again.stdout.splitlines()] == ["skipped", "skipped"]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.kvc")} == first
    assert len(manifest(out)) == 2  # nothing new to record
    (corpus / "doc1.txt").write_text("A changed document about ships.", encoding="utf-8")
    changed = invoke(*args, "--json")
    assert [json.loads(line)["status"] for line in changed.stdout.splitlines()] == ["skipped", "ok"]
    other_budget = invoke(*args[:-len(FAST_BATCH)], *FAST_BATCH[2:], "--budget", "40", "--json")
    assert [json.loads(line)["status"] for line in other_budget.stdout.splitlines()] == ["ok", "ok"]


def test_a_kvc_written_before_its_manifest_line_is_recorded_on_resume(corpus, model, tmp_path):
    out = tmp_path / "out"
    args = ["compress", corpus / "doc0.txt", corpus / "doc1.txt", "-o", out, "--model", model, *FAST_BATCH]
    assert_ok(invoke(*args))
    lines = (out / MANIFEST).read_text().splitlines()
    (out / MANIFEST).write_text(lines[0] + "\n" + lines[1][:20])  # the second line torn by a crash
    assert_ok(invoke(*args))
    kept = (out / MANIFEST).read_text().splitlines()
    assert kept[:2] == [lines[0], lines[1][:20]]  # the torn line is left alone, never glued to the next one
    assert [json.loads(line)["kvc"] for line in kept[::2]] == ["doc0.kvc", "doc1.kvc"] and len(kept) == 3


def test_a_manifest_from_an_earlier_version_still_says_what_is_done(corpus, model, tmp_path):
    """Manifests written before `source_file_sha256` named the file's hash `source_sha256`: a re-run reads both."""
    out = tmp_path / "out"
    args = ["compress", corpus / "doc0.txt", corpus / "doc1.txt", "-o", out, "--model", model, *FAST_BATCH]
    assert_ok(invoke(*args))
    old = [{("source_sha256" if k == "source_file_sha256" else k): v for k, v in r.items()} for r in manifest(out)]
    (out / MANIFEST).write_text("".join(json.dumps(r) + "\n" for r in old), encoding="utf-8")
    again = invoke(*args, "--json")
    assert [json.loads(line)["status"] for line in again.stdout.splitlines()] == ["skipped", "skipped"]
    assert manifest(out) == old  # recognised as recorded: no line added


def test_shards_split_the_corpus_whatever_the_argument_order(corpus, model, tmp_path):
    files = sorted(str(p) for p in corpus.rglob("*") if p.is_file())
    seen = []
    for i, order in ((0, files), (1, files[::-1]), (2, files[1:] + files[:1])):
        out = tmp_path / f"shard{i}"
        result = invoke("compress", *order, "-o", f"{out}/", "--shard", f"{i}/3", "--model", model, *FAST_BATCH)
        assert_ok(result)
        seen += [(r["source"], r["kvc"]) for r in manifest(out)] if (out / MANIFEST).exists() else []
    assert sorted(s for s, _ in seen) == files
    assert sorted(k for _, k in seen) == sorted(kvc_names(files).values())


def test_batch_output_is_the_same_as_one_file_at_a_time(corpus, model, tmp_path):
    """The same cache, and the same --json fields: a batch's line carries every field of one document's (its
    manifest's besides), so that a script reads either (they differed: `output`, `document`, `file_bytes` against
    `kvc`, `source`, `document_tokens`, `bytes`)."""
    out = tmp_path / "out"
    lines = invoke("compress", corpus / "doc2.txt", corpus / "doc0.txt", "-o", out, "--model", model, *FAST_BATCH,
                   "--json")
    assert_ok(lines)
    single = invoke("compress", corpus / "doc0.txt", "-o", tmp_path / "one.kvc", "--model", model, *FAST_BATCH,
                    "--json")
    assert_ok(single)
    one, many = tensors_of(tmp_path / "one.kvc"), tensors_of(out / "doc0.kvc")
    assert one.keys() == many.keys() and all((one[k] == many[k]).all() for k in one)
    alone = json.loads(single.stdout)
    record = [json.loads(line) for line in lines.stdout.splitlines()][1]
    assert set(alone) <= set(record), set(alone) - set(record)
    assert alone["output"] == str(tmp_path / "one.kvc") and record["output"] == str(out / "doc0.kvc")
    assert record["file_bytes"] == record["bytes"] == (out / "doc0.kvc").stat().st_size
    assert (alone["source"], alone["status"]) == (record["source"], record["status"]) == (str(corpus / "doc0.txt"),
                                                                                           "ok")
    for key in ("document", "kept_entries", "kept_budget", "budget", "method", "cache_dtype", "estimated_kl",
                "cache_bytes", "model"):
        assert alone[key] == record[key], key
    assert manifest(out)[1]["document"] == alone["document"]  # the manifest keeps them too


@pytest.mark.parametrize(("extra", "needle"), [
    (["--shard", "3/3"], "--shard"),
    (["-o", "-"], "standard output"),
    (["-o", "OUT.kvc"], "folder"),
    (["--engine", "spark"], "--engine"),
    (["--workers", "0"], "--workers"),
    (["--workers", "2"], "--engine ray"),
])
def test_batch_usage_errors(corpus, model, extra, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["compress", corpus / "doc0.txt", corpus / "doc1.txt", "--model", model, *FAST_BATCH]
    if "-o" not in extra:
        args += ["-o", "out/"]
    assert_error(invoke(*args, *extra), 2, needle)


def test_a_file_given_as_outdir_is_refused_as_not_a_folder(corpus, tmp_path, monkeypatch):
    """`-o notes.txt/` (an existing file, or a device, with a slash) was read as a folder, and the batch failed on
    "notes.txt/manifest.jsonl: cannot read it (Not a directory)"; a folder below a file cannot be created."""
    monkeypatch.setattr(reading, "_session", lambda *a: pytest.fail("the model was loaded"))
    notes = tmp_path / "notes.txt"
    notes.write_text("mine", encoding="utf-8")
    doc = corpus / "doc0.txt"
    assert_error(invoke("compress", doc, "-o", f"{notes}/"), 2, f"-o {notes}/ is a file, not a folder")
    assert_error(invoke("compress", doc, "-o", f"{notes}/sub/"), 7, "cannot create the folder (Not a directory)")
    assert notes.read_text(encoding="utf-8") == "mine"


def test_an_empty_shard_says_so(corpus, tmp_path, monkeypatch):
    """A shard that takes none of the documents printed "0 compressed, 0 already done, 0 failed" alone."""
    monkeypatch.setattr(reading, "_session", lambda *a: pytest.fail("the model was loaded"))
    doc = corpus / "doc0.txt"
    other = next(i for i in range(2) if not in_shard(hashlib.sha256(doc.read_bytes()).hexdigest(), (i, 2)))
    result = invoke("compress", doc, "-o", f"{tmp_path}/out/", "--shard", f"{other}/2")
    assert_ok(result)
    assert f"note: shard {other}/2 takes none of the 1 document given" in result.stderr
    assert result.stdout.startswith("0 compressed, 0 already done, 0 failed")
    assert_error(invoke("compress", doc, "-o", f"{tmp_path}/out/", "--shard", "0/1000000"), 2, "999999")


def test_an_interrupted_batch_says_what_it_keeps(corpus, tmp_path, monkeypatch):
    """Ctrl-C after some caches said only "interrupted": that they are kept, and a re-run goes on, went unsaid."""
    def stopped(sources, folder, engine, on_record):
        on_record({"status": "ok", "source": sources[0].path, "kvc": sources[0].kvc, "document_tokens": 9,
                   "kept_entries": 9, "bytes": 9, "seconds": 0.1})
        raise KeyboardInterrupt

    monkeypatch.setattr(batch, "run_batch", stopped)
    result = invoke("compress", corpus / "doc0.txt", corpus / "doc1.txt", "-o", f"{tmp_path}/out/")
    assert result.exit_code == 130, _show(result)
    assert result.stderr.splitlines() == [
        f"note: {tmp_path}/out keeps the 1 cache done of 2; the same command goes on from there", "interrupted"]


def test_a_glob_that_matches_nothing_fails_before_the_model_loads(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "_session", lambda *a: pytest.fail("the model was loaded"))
    assert_error(invoke("compress", corpus / "*.nothing", corpus / "doc0.txt", "-o", f"{tmp_path}/"), 2,
                 "no file matches")


def test_one_input_and_a_kvc_name_behaves_as_before(corpus, model, tmp_path):
    result = invoke("compress", corpus / "doc0.txt", "-o", tmp_path / "x.kvc", "--model", model, *FAST_BATCH)
    assert_ok(result)
    assert result.stdout.startswith("wrote ") and not (tmp_path / MANIFEST).exists()
    assert_error(invoke("compress", corpus / "doc0.txt", "-o", tmp_path, "--model", model), 2, "directory")


def test_expand_inputs_dedupes_and_orders(corpus):
    paths = batch.expand_inputs([str(corpus / "doc1.txt"), str(corpus), str(corpus / "*.txt")])
    assert paths[0] == str(corpus / "doc1.txt") and len(paths) == len(set(paths)) == 5


def test_without_ray_the_error_names_the_extra(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    assert_error(invoke("compress", corpus / "doc0.txt", "-o", f"{tmp_path}/", "--engine", "ray"), 2,
                 "klevict[ray]")


# ---- ask across caches ---------------------------------------------------------------------------------------
@pytest.fixture
def outdir(corpus, model, tmp_path) -> Path:
    out = tmp_path / "caches"
    assert_ok(invoke("compress", corpus / "doc0.txt", corpus / "doc1.txt", "-o", f"{out}/", "--model", model,
                     *FAST_BATCH))
    return out


def test_ask_a_folder_answers_from_every_cache_with_one_model_load(outdir, corpus, monkeypatch):
    loads = []
    real = reading._session.__wrapped__
    reading._session.cache_clear()
    monkeypatch.setattr(reading, "_session", lambda *a: loads.append(a) or real(*a))
    result = invoke("ask", outdir, "Who is Ishmael?", *GEN, "--json")
    assert_ok(result)
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [Path(a["cache"]).name for a in answers] == ["doc0.kvc", "doc1.kvc"]
    assert [a["source"] for a in answers] == [str(corpus / "doc0.txt"), str(corpus / "doc1.txt")]
    assert all(a["status"] == "ok" and a["question"] == "Who is Ishmael?" for a in answers)
    assert len(loads) == 1
    single = invoke("ask", outdir / "doc1.kvc", "Who is Ishmael?", *GEN, "--json")
    assert json.loads(single.stdout)["answer"] == answers[1]["answer"]


def test_ask_several_files_plain_output_names_each_cache(outdir):
    result = invoke("ask", outdir / "doc1.kvc", outdir / "doc0.kvc", "Who is Ishmael?", *GEN)
    assert_ok(result)
    headers = [line for line in result.stdout.splitlines() if line.startswith("==> ")]
    assert [Path(h.split()[1]).name for h in headers] == ["doc1.kvc", "doc0.kvc"]


def test_ask_answers_a_cache_named_twice_once(outdir):
    """A folder and a file in it (or one file twice): each cache once, in the order first named."""
    result = invoke("ask", outdir / "doc1.kvc", outdir, outdir / ".." / outdir.name / "doc1.kvc", "Who is Ishmael?",
                    *GEN, "--json")
    assert_ok(result)
    assert [Path(json.loads(line)["cache"]).name for line in result.stdout.splitlines()] == ["doc1.kvc", "doc0.kvc"]


def test_ask_many_reports_a_bad_cache_and_answers_the_rest(outdir):
    (outdir / "bad.kvc").write_bytes(b"not a cache")
    result = invoke("ask", outdir, "Who is Ishmael?", *GEN, "--json")
    _no_crash(result)
    assert result.exit_code == EXIT_SOME_FAILED, _show(result)
    answers = {Path(a["cache"]).name: a for a in map(json.loads, result.stdout.splitlines())}
    assert answers["bad.kvc"]["status"] == "failed" and answers["bad.kvc"]["error"] == "CacheFileError"
    assert answers["doc0.kvc"]["status"] == answers["doc1.kvc"]["status"] == "ok"
    (outdir / "a-bad.kvc").write_bytes(b"not a cache")  # first by name: its error, then no blank line on stdout
    plain = invoke("ask", outdir, "Who is Ishmael?", *GEN)
    assert plain.exit_code == EXIT_SOME_FAILED and plain.stdout.startswith("==> "), _show(plain)


def test_ask_a_folder_without_caches_is_a_bad_cache(tmp_path):
    assert_error(invoke("ask", tmp_path, "Who?"), 4, "no .kvc files")


def test_rerunning_a_finished_batch_skips_every_document_without_loading_the_model(corpus, model, tmp_path,
                                                                                   monkeypatch):
    import shutil

    local_model = tmp_path / "model"
    shutil.copytree(model, local_model)
    out = tmp_path / "out"
    args = ["compress", corpus / "doc0.txt", corpus / "doc1.txt", "-o", out, "--model", local_model, *FAST_BATCH]
    assert_ok(invoke(*args))
    loads = []
    real_worker = batch.Worker
    monkeypatch.setattr(batch, "Worker", lambda opts: loads.append(opts) or real_worker(opts))
    again = invoke(*args, "--json")
    assert_ok(again)
    assert [json.loads(line)["status"] for line in again.stdout.splitlines()] == ["skipped", "skipped"]
    assert loads == []  # the manifest and the caches decided it; the model was never loaded
    weights = next(p for p in local_model.iterdir() if p.suffix == ".safetensors")
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # touched, not changed
    touched = invoke(*args, "--json")
    assert [json.loads(line)["status"] for line in touched.stdout.splitlines()] == ["skipped", "skipped"]
    assert len(loads) == 1  # in doubt, the model is loaded and its identity decides, as before


def test_a_packaged_model_is_stamped_by_its_files_so_a_rerun_need_not_load_it(monkeypatch):
    """The default model (and any packaged one) is recognised by its GGUF files' paths, sizes and times, found
    without importing torch or the wheel; a packaged model that is not installed gives no stamp (the model decides)."""
    from klevict_cli import packaged

    stamp = batch.model_stamp(None)
    assert stamp == batch.model_stamp("smollm2-135m") and stamp[0] == "smollm2-135m"
    gguf = packaged.packaged_files("smollm2-135m")[0]
    assert stamp[1] == [str(gguf), gguf.stat().st_size, gguf.stat().st_mtime_ns]
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "absent", packaged.PackagedModel("no_such_module_x", "m.gguf", "-"))
    assert batch.model_stamp("absent") is None
    assert batch.model_stamp("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a hub id


def test_a_batch_records_and_shows_how_a_document_was_decoded(corpus, model, tmp_path):
    (corpus / "doc0.txt").write_bytes(b"Caf\xe9 ships counted on Monday.")
    out = tmp_path / "out"
    result = invoke("compress", corpus / "doc0.txt", corpus / "doc1.txt", "-o", out, "--model", model, *FAST_BATCH)
    assert_ok(result)
    assert "is not UTF-8 (1 non-ASCII byte 0xe9 at line 1, offset 3); read it as Windows-1252" in result.stderr
    assert "read it as Windows-1252" in manifest(out)[0]["notes"][0]


def test_a_batch_within_a_byte_limit_stores_each_cache_as_chosen_and_redoes_it_when_the_limit_changes(
        corpus, model, tmp_path):
    from klevict_cli.kvc import read_metadata

    out = tmp_path / "out"
    args = ["compress", corpus / "doc0.txt", corpus / "doc1.txt", "-o", out, "--model", model, *FAST,
            "--no-reconstruct"]
    assert_ok(invoke(*args, "--max-bytes", "20%"))
    for record in manifest(out):
        meta = read_metadata(out / record["kvc"])
        assert meta["max_bytes"] == "20%" and meta["cache_dtype"] in ("float16", "int8", "int4")
    again = invoke(*args, "--max-bytes", "10%", "--json")
    assert [json.loads(line)["status"] for line in again.stdout.splitlines()] == ["ok", "ok"]


@pytest.mark.skipif(sys.platform != "linux", reason="other systems refuse such file names")
def test_a_file_name_that_is_not_utf8_is_recorded_with_escapes(corpus, model, tmp_path):
    odd = os.fsdecode(bytes(corpus) + b"/bad\xffname.txt")
    shutil.copyfile(corpus / "doc0.txt", odd)
    out = tmp_path / "out"
    assert_ok(invoke("compress", odd, corpus / "doc1.txt", "-o", f"{out}/", "--model", model, *FAST_BATCH))
    sources = [json.loads(line)["source"] for line in (out / MANIFEST).read_text(encoding="utf-8").splitlines()]
    assert any(s.endswith("bad\\xffname.txt") for s in sources) and (out / "bad_name.kvc").exists()
    again = invoke("compress", odd, corpus / "doc1.txt", "-o", f"{out}/", "--model", model, *FAST_BATCH)
    assert_ok(again)
    assert "0 compressed, 2 already done" in again.stdout + again.stderr  # the escaped name is the same source
