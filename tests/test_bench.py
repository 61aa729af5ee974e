"""`klevict bench` end to end on a tiny random model: every field in its JSON, exactness at a 100 % budget, the same
seed giving the same numbers, and the pieces (metrics, intervals, windows, needles) on their own."""

from __future__ import annotations

import json
import random

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from klevict_cli.bench import (
    BenchSettings,
    Fact,
    clear_offsets,
    crowded,
    draw_offsets,
    insert_facts,
    lane_logits,
    make_facts,
    parse_budgets,
    parse_methods,
    _estimate_cell,
    render,
    run_bench,
    sampled_continuations,
    summary,
    token_metrics,
)
from klevict_cli.cli import app
from klevict_cli.documents import Document
from klevict_cli.prompts import encode_text
from klevict_cli.errors import ResourceError, UsageError
from klevict_cli.policies import POLICIES
from tests.conftest import CORPUS, tiny_session

TEXT = " ".join(CORPUS * 25)
TIMING_KEYS = {"seconds", "time_ratio", "peak_device_bytes", "created"}  # what a rerun may change
SETTINGS = dict(methods=["snapkv", "h2o"], budgets=["100%", "20%"], windows=2, context=200, continuation=32,
                chunk_size=64, probe_window=8, task="both")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def session():
    return tiny_session()


@pytest.fixture(scope="module")
def document():
    return Document(TEXT, "corpus.txt", "0" * 64)


@pytest.fixture(scope="module")
def result(session, document):
    return run_bench(session, document, BenchSettings(**SETTINGS))


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


# ---- end to end ------------------------------------------------------------------------------------------------
def test_bench_json_has_every_field(result):
    result = json.loads(json.dumps(result))  # JSON-ready as returned
    settings = result["settings"]
    for key in ("model", "seed", "windows", "context", "continuation", "chunk_size", "probe_window", "methods",
                "budgets", "budget_tokens", "task", "document", "versions", "device", "dtype", "method_params"):
        assert key in settings, key
    assert settings["budget_tokens"] == {"100%": 200, "20%": 40}
    assert set(settings["versions"]) == {"klevict", "torch", "transformers", "python"}
    fid = result["fidelity"]
    assert len(fid["offsets"]) == 2 and fid["continuation_tokens"] == 32
    assert len(fid["full"]["per_window"]["perplexity"]) == 2 and fid["full"]["perplexity"]["mean"] > 1
    for method in ("snapkv", "h2o"):
        for label in ("100%", "20%"):
            row = fid["results"][method][label]
            for key in ("kl", "top1", "perplexity", "time_ratio", "cache_bytes", "cache_fraction",
                        "peak_cache_bytes"):
                assert set(row[key]) == {"mean", "ci95", "n"} and row[key]["n"] == 2, key
            for key in ("kl", "top1", "nll", "perplexity", "seconds", "time_ratio", "cache_bytes", "kept_entries",
                        "peak_cache_bytes"):
                assert len(row["per_window"][key]) == 2, key
    needle = result["needle"]
    assert len(needle["haystacks"]) == 2
    assert all(len(h["facts"]) == 4 and 0 <= h["facts"][0]["depth"] <= 1 for h in needle["haystacks"])
    for method in ("snapkv", "h2o"):
        for label in ("100%", "20%"):
            row = needle["results"][method][label]
            assert 0 <= row["accuracy"]["mean"] <= 1
            assert [len(a) for a in row["per_window"]["answers"]] == [4, 4]
    assert 0 <= needle["full"]["accuracy"]["mean"] <= 1


def test_full_budget_is_exactly_the_full_cache(result):
    for method in ("snapkv", "h2o"):
        row = result["fidelity"]["results"][method]["100%"]
        assert max(row["per_window"]["kl"]) <= 1e-6
        assert row["top1"]["mean"] == 1.0
        assert row["per_window"]["perplexity"] == pytest.approx(result["fidelity"]["full"]["per_window"]["perplexity"])
        assert row["cache_fraction"]["mean"] == 1.0
        assert result["needle"]["results"][method]["100%"]["per_window"]["answers"] == \
            result["needle"]["full"]["per_window"]["answers"]


def test_a_smaller_budget_keeps_less_and_changes_the_distribution(result):
    row = result["fidelity"]["results"]["snapkv"]["20%"]
    assert row["kl"]["mean"] > 1e-6
    assert row["cache_fraction"]["mean"] == pytest.approx(40 / 200, abs=0.01)
    assert row["peak_cache_bytes"]["mean"] < result["fidelity"]["full"]["per_window"]["peak_cache_bytes"][0]


def test_the_same_seed_gives_the_same_numbers(session, document, result):
    again = run_bench(session, document, BenchSettings(**SETTINGS))
    assert without_timings(again) == without_timings(result)
    other = run_bench(session, document, BenchSettings(**{**SETTINGS, "seed": 1, "task": "fidelity"}))
    assert other["fidelity"]["offsets"] != result["fidelity"]["offsets"]


def test_bench_with_kl_reports_fidelity_and_needles_like_any_method(session, document):
    """kl in the bench, end to end: its parameters are recorded, a full budget is exactly the full cache (look-ahead
    drafts and calibration leave no trace), and a smaller budget keeps what it says and costs more KL."""
    settings = BenchSettings(**{**SETTINGS, "methods": ["kl", "random"], "budgets": ["100%", "50%", "20%"]})
    result = run_bench(session, document, settings)
    assert result["settings"]["method_params"]["kl"]["propagation"] == "direct"
    fidelity, needle = result["fidelity"], result["needle"]
    for label in ("100%", "50%", "20%"):
        row = fidelity["results"]["kl"][label]
        assert all(len(row["per_window"][key]) == 2 for key in ("kl", "top1", "perplexity", "kept_entries"))
        assert [len(a) for a in needle["results"]["kl"][label]["per_window"]["answers"]] == [4, 4]
    full = fidelity["results"]["kl"]["100%"]
    assert max(full["per_window"]["kl"]) <= 1e-6 and full["top1"]["mean"] == 1.0
    assert needle["results"]["kl"]["100%"]["per_window"]["answers"] == needle["full"]["per_window"]["answers"]
    half, fifth = fidelity["results"]["kl"]["50%"], fidelity["results"]["kl"]["20%"]
    assert half["cache_fraction"]["mean"] == pytest.approx(0.5, abs=0.01)
    assert 1e-6 < half["kl"]["mean"] < fifth["kl"]["mean"]


def test_bench_measures_tolerances_beside_budgets(session, document):
    """--max-kl in the bench: each tolerance is a column whose size each window decides — a tolerance no cache
    meets keeps everything read, a loose one little — with the estimated and the measured KL per window; the
    tables show them, and the docs' tables and plots (sized budgets only) leave them out."""
    from klevict_cli.results import budgets

    settings = BenchSettings(**{**SETTINGS, "methods": ["kl"], "budgets": ["20%"], "task": "fidelity",
                                "max_kl": [1e-12, 10.0]})
    result = run_bench(session, document, settings)
    assert result["settings"]["budget_tokens"] == {"20%": 40, "max-kl 1e-12": None, "max-kl 10": None}
    rows = result["fidelity"]["results"]["kl"]
    strict, loose = rows["max-kl 1e-12"]["per_window"], rows["max-kl 10"]["per_window"]
    assert strict["cache_fraction"] == [1.0, 1.0] and max(strict["kl"]) <= 1e-6
    assert all(f < 0.2 for f in loose["cache_fraction"]) and all(e is not None for e in loose["estimated_kl"])
    assert budgets(result) == ["20%"]
    console = Console(record=True, width=200)
    render(result, console)
    text = console.export_text()
    assert "--max-kl: cache kept" in text and "max-kl 10" in text
    assert "estimated drift" in text and _estimate_cell(rows["max-kl 10"]) in text.replace("\n", " ")


def test_bench_measures_each_cache_on_the_models_own_continuations(session, document):
    """--sampled: each cache is also measured on continuations the full cache's model writes itself: nothing moved
    with nothing evicted, something with less kept, the same numbers for the same seed; none asked, none recorded."""
    settings = BenchSettings(**{**SETTINGS, "task": "fidelity", "sampled": 3})
    got = run_bench(session, document, settings)["fidelity"]["results"]["snapkv"]
    assert max(got["100%"]["per_window"]["kl_sampled"]) <= 1e-6
    assert min(got["20%"]["per_window"]["kl_sampled"]) > 1e-4
    assert got["20%"]["kl_sampled"]["n"] == SETTINGS["windows"]
    for mean, lanes in zip(got["20%"]["per_window"]["kl_sampled"], got["20%"]["per_window"]["kl_sampled_lanes"]):
        assert len(lanes) == 3 and sum(lanes) / 3 == pytest.approx(mean) and len(set(lanes)) == 3
    again = run_bench(session, document, settings)["fidelity"]["results"]["snapkv"]
    assert again["20%"]["per_window"]["kl_sampled"] == got["20%"]["per_window"]["kl_sampled"]
    plain = run_bench(session, document, BenchSettings(**{**SETTINGS, "task": "fidelity"}))
    assert "kl_sampled" not in plain["fidelity"]["results"]["snapkv"]["20%"]["per_window"]
    render(run_bench(session, document, BenchSettings(**{**SETTINGS, "task": "fidelity", "sampled": 2,
                                                          "windows": 1})), console := Console(record=True, width=200))
    assert "on the model's own text: 2 continuations of 32 tokens" in " ".join(console.export_text().split())


def test_lanes_read_as_each_continuation_alone(session):
    """The continuations are read side by side (lanes) at the positions a single continuation takes: each lane's
    logits are those of teacher-forcing it alone, and it was drawn from them (step by step, lane by lane)."""
    from klevict_cli.session import ReadSettings

    engine = session.engine("none", None, ReadSettings(budget=None, chunk_size=64), "original")
    stream = engine.new_stream()
    ids = encode_text(session.lm.tokenizer, TEXT)[:90]
    logits = engine.feed(stream, ids)
    lanes, length = 3, 6
    tokens = sampled_continuations(engine, stream, logits, lanes, length, torch.Generator().manual_seed(0))
    together = lane_logits(engine, stream, logits, tokens, lanes)
    assert len(tokens) == lanes * length and together.shape[0] == lanes * length and stream.next_position == 90
    for lane in range(lanes):
        alone = stream.clone()
        own = tokens[lane::lanes]
        rows, _ = engine.forward(alone, own[:-1], logits_rows=length - 1)
        expected = torch.cat((logits.reshape(1, -1).float(), rows.float()))
        torch.testing.assert_close(together[lane::lanes], expected, atol=1e-4, rtol=1e-4)
    assert len(set(tuple(tokens[lane::lanes]) for lane in range(lanes))) > 1  # independent draws


def test_resume_reads_a_run_from_before_sampled_as_without_it(session, document, result):
    saved = json.loads(json.dumps(result))
    del saved["settings"]["sampled"]
    assert run_bench(session, document, BenchSettings(**SETTINGS), resume=saved) is saved  # finished: as it was
    with pytest.raises(UsageError, match=r"other settings: --sampled 0 \(now 2\)$"):
        run_bench(session, document, BenchSettings(**{**SETTINGS, "sampled": 2}), resume=saved)


def test_estimate_cell_compares_each_windows_estimate_with_its_measured_kl():
    """The estimate's table: mean estimate, the median and range of estimated / measured, and how many windows are
    within 1.5x; windows whose read estimated nothing are left out."""
    row = {"per_window": {"kl": [0.01, 0.02, 0.04, 0.5], "estimated_kl": [0.012, 0.05, 0.02, None]}}
    assert _estimate_cell(row) == "0.0273 · 1.20× (0.50–2.50) · 1/3"
    assert _estimate_cell({"per_window": {"kl": [0.01], "estimated_kl": [None]}}) == "–"


def test_bench_measures_each_stored_dtype_of_the_same_read(session, document):
    """--cache-dtype: one read per budget, measured as each dtype stores it (a row per method and dtype); float32 is
    the read itself, fewer bits take fewer bytes, and int4's rounding moves the model more than int8's."""
    base = {**SETTINGS, "methods": ["kl"], "budgets": ["50%"], "task": "fidelity", "windows": 1}
    plain = run_bench(session, document, BenchSettings(**base))["fidelity"]["results"]["kl"]["50%"]["per_window"]
    rows = run_bench(session, document, BenchSettings(**base, cache_dtypes=["float32", "int8", "int4"]))
    rows = rows["fidelity"]["results"]
    assert list(rows) == ["kl float32", "kl int8", "kl int4"]
    f32, i8, i4 = (rows[name]["50%"]["per_window"] for name in rows)
    assert f32["kl"] == pytest.approx(plain["kl"], abs=1e-7)
    assert f32["cache_bytes"][0] > 2.5 * i8["cache_bytes"][0] > 0 and i8["cache_bytes"][0] > i4["cache_bytes"][0]
    assert f32["kept_entries"] == i8["kept_entries"] == i4["kept_entries"]
    # the rounding is noise about float32's choice (either side of it by chance), int4's coarser than int8's
    assert f32["kl"][0] != i8["kl"][0] and abs(i4["kl"][0] - f32["kl"][0]) > abs(i8["kl"][0] - f32["kl"][0])
    assert (f32["cache_dtype"], i4["cache_dtype"]) == (["float32"], ["int4"])


def test_bench_measures_byte_limits_as_compress_stores_them(session, document):
    """--max-bytes: each limit's read chooses a dtype; its cache is measured as stored, within the limit."""
    settings = BenchSettings(**{**SETTINGS, "methods": ["kl"], "budgets": ["20%"], "task": "fidelity",
                                "windows": 1, "max_bytes": ["10%"]})
    result = run_bench(session, document, settings)
    assert result["settings"]["budget_tokens"]["max-bytes 10%"] is None
    row = result["fidelity"]["results"]["kl"]["max-bytes 10%"]["per_window"]
    assert row["cache_dtype"][0] in ("float16", "int8", "int4")
    assert 0 < row["cache_fraction"][0] <= 0.1
    console = Console(record=True, width=200)
    render(result, console)
    text = console.export_text()
    assert "--max-bytes: bytes kept" in text
    assert " 1 window · " in text and "(n = 1)" in text and "± 0.0000" not in text  # one window: no interval


def test_render_on_a_narrow_console_keeps_method_names_whole(result):
    """A piped bench is 80 columns wide: with five budgets a long method name came out as 'expected_…' in every
    table (this result has two budgets: 50 columns)."""
    long = json.loads(json.dumps(result))
    for block in (long["fidelity"], long["needle"]):
        block["results"]["expected_attention"] = block["results"].pop("snapkv")
    console = Console(record=True, width=50)
    render(long, console)
    text = console.export_text()
    assert "…" not in text and text.count("expected_attention") >= 3


def test_render_prints_every_method_and_budget(result):
    console = Console(record=True, width=200)
    render(result, console)
    text = console.export_text()
    for word in ("snapkv", "h2o", "100% (200)", "20% (40)", "KL", "cost", "needle"):
        assert word in text
    assert "estimated drift" not in text  # no read estimated its drift


def test_bench_refuses_windows_that_do_not_fit(session, document):
    with pytest.raises(ResourceError, match="positions"):
        run_bench(session, document, BenchSettings(**{**SETTINGS, "context": 100_000, "task": "fidelity"}))
    with pytest.raises(UsageError, match="the document has [0-9]+ tokens"):
        run_bench(session, Document("Call me Ishmael.", "short.txt", "0"), BenchSettings(**SETTINGS))


def test_windows_that_overlap_are_said_before_they_are_measured(session, document):
    """The text holds fewer windows apart than --windows asks: they are drawn over one another (draw_offsets), and
    the intervals, which count windows as independent, come out too narrow; the user is told before the run."""
    assert crowded([0, 100, 300], 600, 100) == []
    assert crowded([0, 50, 300], 400, 100) == [
        "1 of the 3 windows overlaps an earlier one: the document's 400 tokens hold 4 apart (100 tokens each), and the"
        " intervals over windows count them as independent, so they are too narrow (lower --windows or --context, or"
        " give a longer document)"]
    lines: list[str] = []
    short = Document(" ".join(CORPUS * 2), "short.txt", "0" * 64)
    n_tokens = len(encode_text(session.lm.tokenizer, short.text))
    frame = len(session.frame.prefix_ids(session.lm.tokenizer))
    wide = n_tokens // 2 + frame  # with the continuation, two such windows cannot lie apart
    run_bench(session, short, BenchSettings(**{**SETTINGS, "methods": ["streaming"], "budgets": ["50%"],
                                               "windows": 3, "context": wide, "task": "fidelity"}),
              note=lines.append)
    assert len(lines) == 1 and lines[0].startswith("2 of the 3 windows overlap an earlier one")
    lines.clear()
    run_bench(session, document, BenchSettings(**{**SETTINGS, "methods": ["streaming"], "budgets": ["50%"],
                                                  "windows": 2, "task": "fidelity"}), note=lines.append)
    assert lines == []


def test_bench_refuses_a_context_the_chat_frame_fills(session, document):
    """A window's context counts the chat frame's opening: one no longer than it read no document (its windows were
    empty, and the 'continuation' began before the text), and was measured and reported as if it had."""
    frame = len(session.frame.prefix_ids(session.lm.tokenizer))
    for context in (1, frame):
        with pytest.raises(UsageError, match=f"invalid --context {context}; the chat frame's opening takes {frame}"):
            run_bench(session, document, BenchSettings(**{**SETTINGS, "context": context, "task": "fidelity"}))


# ---- the pieces ------------------------------------------------------------------------------------------------
def test_token_metrics():
    torch.manual_seed(0)
    logits = torch.randn(5, 11)
    targets = torch.randint(0, 11, (5,))
    same = token_metrics(logits, logits, targets)
    assert same["kl"] == 0 and same["top1"] == 1
    nll = -logits.double().log_softmax(-1)[torch.arange(5), targets].mean().item()
    assert same["nll"] == pytest.approx(nll) and same["perplexity"] == pytest.approx(torch.tensor(nll).exp().item())
    other = logits + torch.randn(5, 11)
    p, q = logits.double().log_softmax(-1), other.double().log_softmax(-1)
    expected = (p.exp() * (p - q)).sum(-1).mean().item()
    assert token_metrics(logits, other, targets)["kl"] == pytest.approx(expected)


def test_summary_interval():
    s = summary([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["n"] == 4
    assert s["ci95"] == pytest.approx(1.96 * (5 / 3) ** 0.5 / 2)
    assert summary([3.0]) == {"mean": 3.0, "ci95": 0.0, "n": 1}


def test_offsets_fit_and_repeat():
    offsets = draw_offsets(1000, 300, 50, random.Random(0))
    assert all(0 <= o <= 700 for o in offsets) and offsets == draw_offsets(1000, 300, 50, random.Random(0))


def test_windows_are_drawn_clear_of_each_other_and_more_windows_keep_the_first():
    for seed in range(20):
        offsets = draw_offsets(100_000, 16_640, 4, random.Random(seed))
        assert all(abs(a - b) >= 16_640 for i, a in enumerate(offsets) for b in offsets[:i]), (seed, offsets)
        assert draw_offsets(100_000, 16_640, 5, random.Random(seed))[:4] == offsets
    # a draw that overlapped nothing is where a plain uniform draw puts it: earlier runs' windows stay put
    rng = random.Random(1)
    assert draw_offsets(10**7, 100, 3, random.Random(1)) == [rng.randint(0, 10**7 - 100) for _ in range(3)]
    # no room for separate windows: they overlap rather than fail
    assert len(draw_offsets(1000, 600, 3, random.Random(0))) == 3
    rng = random.Random(2)
    for _ in range(200):  # the places left clear, against every offset tried one by one
        last, span = rng.randint(0, 60), rng.randint(1, 15)
        taken = [rng.randint(0, last) for _ in range(rng.randint(0, 4))]
        runs = clear_offsets(last, span, taken)
        assert [o for a, b in runs for o in range(a, b + 1)] == \
            [o for o in range(last + 1) if all(abs(o - t) >= span for t in taken)], (last, span, taken, runs)


def test_facts_go_between_sentences():
    rng = random.Random(0)
    facts = make_facts(rng, 4)
    assert len({f.number for f in facts}) == 4 and len({(f.adjective, f.animal) for f in facts}) == 4
    text = "One fish swam. Two birds flew! Three cats slept? Four dogs barked. Five frogs sang."
    out = insert_facts(text, facts, rng)
    for fact in facts:
        assert fact.sentence in out and fact.number in fact.sentence and fact.number not in fact.question
        assert out == text or fact.depth == pytest.approx(out.index(fact.sentence) / len(out))
    assert out.replace(" ", "").count(".") == text.replace(" ", "").count(".") + 4
    for sentence in ("One fish swam.", "Two birds flew!", "Three cats slept?", "Four dogs barked."):
        assert sentence in out  # no original sentence was cut
    assert Fact("red", "fox", "1234").sentence == "The secret code of the red fox is 1234."


def test_parse_methods_and_budgets():
    everything = parse_methods("all", POLICIES)
    assert "none" not in everything and set(everything) == set(POLICIES) - {"none", "kl-fisher", "kl-layer", "kl-reconstruct"}
    assert parse_methods("snapkv, h2o", POLICIES) == ["snapkv", "h2o"]
    for bad in ("nope", "none", "snapkv,snapkv", ""):
        with pytest.raises(UsageError):
            parse_methods(bad, POLICIES)
    assert [str(b) for b in parse_budgets("20%,10%, 512")] == ["20%", "10%", "512"]
    with pytest.raises(UsageError):
        parse_budgets("20%,20%")
    with pytest.raises(UsageError, match=r"^invalid --budgets '0' \(a count of entries must be at least 1\)"):
        parse_budgets("20%,0")  # bench's own flag: it has no --budget


# ---- the command line ------------------------------------------------------------------------------------------
def test_cli_bench_writes_json_and_prints_tables(tiny_model_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "bench.json"
    runner = CliRunner()
    args = ["bench", str(doc), "--model", str(tiny_model_dir), "--methods", "streaming,tova", "--budgets", "50%,10%",
            "--windows", "2", "--context", "150", "--continuation", "16", "--chunk-size", "64", "--quiet"]
    res = runner.invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 0, (res.stdout, res.stderr, res.exception)
    assert "streaming" in res.stdout and "tova" in res.stdout and "KL" in res.stdout
    data = json.loads(out.read_text())
    assert data["settings"]["methods"] == ["streaming", "tova"] and "fidelity" in data and "needle" not in data
    assert data["settings"]["model"] == str(tiny_model_dir)
    # --json is a flag, as for every other command: the same raw numbers as one JSON object on stdout
    printed = runner.invoke(app, [*args, "--json"])
    assert printed.exit_code == 0, (printed.stdout, printed.stderr, printed.exception)
    assert len(printed.stdout.splitlines()) == 1
    again = json.loads(printed.stdout)
    assert without_timings(again["settings"]) == without_timings(data["settings"])
    assert again["fidelity"]["full"].keys() == data["fidelity"]["full"].keys()
    bad = runner.invoke(app, ["bench", str(doc), "--model", str(tiny_model_dir), "--methods", "nope"])
    assert bad.exit_code == 2 and bad.stderr.startswith("error:")
    bad = runner.invoke(app, ["bench", str(doc), "--model", str(tiny_model_dir), "--task", "poetry"])
    assert bad.exit_code == 2 and "--task" in bad.stderr


def test_cli_bench_checks_where_it_will_write_before_measuring(tiny_model_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT, encoding="utf-8")
    runner = CliRunner()
    base = ["bench", str(doc), "--model", str(tiny_model_dir), "--quiet"]
    missing = runner.invoke(app, [*base, "--out", str(tmp_path / "no-such-folder" / "bench.json")])
    assert missing.exit_code == 7 and missing.stderr.startswith("error: --out") and "does not exist" in missing.stderr
    folder = runner.invoke(app, [*base, "--out", str(tmp_path)])
    assert folder.exit_code == 2 and "is a directory" in folder.stderr


def test_recall_leaves_out_a_window_that_asks_nothing(session, document):
    """A window without a name or number stated once asks no recall question: it counted as 0 % (0 of 0) for the
    full cache and every method, and the means fell with it. It is left out of the mean, the table says over how
    many windows; a text whose windows ask nothing (`document`: every word repeats) is refused before any read."""
    settings = BenchSettings(**{**SETTINGS, "task": "recall", "methods": ["streaming"], "budgets": ["50%"]})
    ahab = Document("The crew then met old Captain Ahab at noon. " + TEXT[:400], "ahab.txt", "0" * 64)
    result = run_bench(session, ahab, settings)
    recall = result["recall"]
    assert [len(h["facts"]) for h in recall["haystacks"]] == [0, 1]
    assert recall["full"]["per_window"]["accuracy"][0] is None and recall["full"]["accuracy"]["n"] == 1
    assert recall["results"]["streaming"]["50%"]["accuracy"]["n"] == 1
    console = Console(record=True, width=200)
    render(result, console)
    assert "exact-match accuracy, mean over 1 window (1 question)" in " ".join(console.export_text().split())
    with pytest.raises(UsageError, match="nothing to ask; give a larger --context"):
        run_bench(session, document, settings)


def test_pick_recalls_finds_details_stated_once():
    import random

    from klevict_cli.bench import pick_recalls

    text = "The ship sailed on. We met old Captain Ahab near the dock that day. The sea was calm and the ship was slow."
    (recall,) = pick_recalls(text, random.Random(0), 3)
    assert recall.expected == "Ahab" and recall.start == '"We met old Captain'


def test_checkpoints_hold_every_window_measured_so_far(session, document, result):
    """A stopped run keeps what it measured: after each window the result so far, the last one equal to the end."""
    seen = []
    final = run_bench(session, document, BenchSettings(**SETTINGS),
                      checkpoint=lambda partial: seen.append(json.loads(json.dumps(partial))))
    windows = SETTINGS["windows"]
    tasks = [t for t in ("fidelity", "needle", "recall") if t in final]
    assert len(seen) == windows * len(tasks)
    first = seen[0]
    assert first["complete"] is False and first[tasks[0]]["windows_done"] == 1
    assert all(len(row["per_window"]["kl"]) == 1 for per in first["fidelity"]["results"].values()
               for row in per.values())
    assert final["complete"] is True
    assert without_timings(seen[-1][tasks[-1]]) == without_timings(json.loads(json.dumps(final[tasks[-1]])))


def test_a_resumed_run_keeps_the_saved_windows_and_measures_the_rest(session, document, result):
    """Stopped after its first window and resumed (with more windows planned), a run gives the numbers an unbroken
    run gives: the saved window is kept as it was, the others are measured, and the result says it was resumed."""
    stopped = []
    run_bench(session, document, BenchSettings(**{**SETTINGS, "windows": 1, "task": "fidelity"}),
              checkpoint=lambda partial: stopped.append(json.loads(json.dumps(partial))))
    saved = stopped[0]
    saved["fidelity"]["results"]["snapkv"]["20%"]["per_window"]["kl"][0] = 123.0  # kept, not measured again
    resumed = json.loads(json.dumps(run_bench(session, document, BenchSettings(**{**SETTINGS, "task": "fidelity"}),
                                              resume=saved)))
    assert resumed["settings"]["resumed_from"][0]["fidelity"] == 1
    rows, whole = resumed["fidelity"]["results"]["snapkv"]["20%"]["per_window"], result["fidelity"]["results"]
    assert rows["kl"][0] == 123.0 and rows["kl"][1:] == whole["snapkv"]["20%"]["per_window"]["kl"][1:]
    assert resumed["fidelity"]["windows_done"] == SETTINGS["windows"]


def test_resuming_a_finished_run_leaves_it_as_it_was(session, document, result):
    """Nothing left to measure: the saved run comes back unchanged, not re-dated or marked as resumed."""
    saved = json.loads(json.dumps(result))
    assert run_bench(session, document, BenchSettings(**SETTINGS), resume=saved) == json.loads(json.dumps(result))


def test_resume_refuses_a_run_that_measured_something_else(session, document, result):
    saved = json.loads(json.dumps(result))
    context = SETTINGS["context"]
    with pytest.raises(UsageError, match=rf"other settings: --context {context} \(now 180\)$"):
        run_bench(session, document, BenchSettings(**{**SETTINGS, "context": 180}), resume=saved)
    methods = ",".join(SETTINGS["methods"])
    with pytest.raises(UsageError, match=rf"other settings: --methods {methods} \(now snapkv\)$"):
        run_bench(session, document, BenchSettings(**{**SETTINGS, "methods": ["snapkv"]}), resume=saved)


def test_resume_with_fewer_windows_than_a_stopped_run_measured_says_so(session, document, result):
    """A stopped run with more windows measured than --windows now asks: "the saved run's windows are not this run's
    first 2 (offsets differ)", though they agree as far as they go."""
    stopped = {**json.loads(json.dumps(result)), "complete": False}
    with pytest.raises(UsageError, match="has measured 2 windows, more than --windows 1; give --windows 2 or more"):
        run_bench(session, document, BenchSettings(**{**SETTINGS, "windows": 1}), resume=stopped)


def test_cli_resume_needs_out_and_a_readable_result(tiny_model_dir, tmp_path):
    base = ["bench", "-", "--model", str(tiny_model_dir), "--methods", "snapkv", "--budgets", "50%", "--windows",
            "1", "--context", "64", "--continuation", "8", "--chunk-size", "32", "--quiet", "--resume"]
    runner = CliRunner()
    no_out = runner.invoke(app, base, input=TEXT)
    assert no_out.exit_code != 0 and "give --out" in no_out.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    bad = runner.invoke(app, [*base, "--out", str(broken)], input=TEXT)
    assert bad.exit_code != 0 and bad.stderr.startswith("error: --resume") and broken.read_text() == "{not json"


def test_a_run_without_resume_does_not_replace_a_stopped_run(tiny_model_dir, tmp_path):
    """`bench --out F` run again without --resume replaced F at its first window: the windows a stopped run had
    measured were lost. Refused, before the model loads; a finished result is replaced as asked."""
    base = ["bench", "-", "--model", str(tiny_model_dir), "--methods", "snapkv", "--budgets", "50%", "--windows",
            "1", "--context", "64", "--continuation", "8", "--chunk-size", "32", "--quiet"]
    runner = CliRunner()
    stopped = tmp_path / "run.json"
    text = json.dumps({"settings": {"windows": 8}, "complete": False, "fidelity": {"windows_done": 3}})
    stopped.write_text(text)
    refused = runner.invoke(app, [*base, "--out", str(stopped)], input=TEXT)
    assert refused.exit_code == 2 and stopped.read_text() == text
    assert refused.stderr.startswith("error: --out") and "(windows measured: fidelity 3 of 8)" in refused.stderr
    assert "--resume" in refused.stderr and len(refused.stderr.splitlines()) == 1
    stopped.write_text(text.replace("false", "true"))
    replaced = runner.invoke(app, [*base, "--out", str(stopped)], input=TEXT)
    assert replaced.exit_code == 0 and json.loads(stopped.read_text())["fidelity"]["windows_done"] == 1


def test_plot_and_out_naming_one_new_file_are_refused(tiny_model_dir, tmp_path):
    """`--out r.svg --plot r.svg`: neither existed, both were accepted, and the plot replaced the result (exit 0)."""
    pytest.importorskip("matplotlib")
    target = tmp_path / "r.svg"
    base = ["bench", "-", "--model", str(tiny_model_dir), "--methods", "snapkv", "--budgets", "50%", "--windows",
            "1", "--context", "64", "--continuation", "8", "--chunk-size", "32", "--quiet"]
    result = CliRunner().invoke(app, [*base, "--out", str(target), "--plot", str(tmp_path / "." / "r.svg")],
                                input=TEXT)
    assert result.exit_code == 2 and "name one file" in result.stderr and not target.exists()


def test_an_interrupted_run_says_its_windows_are_kept(tiny_model_dir, tmp_path, monkeypatch):
    """Ctrl-C after some windows said only "interrupted": the saved windows, and --resume, went unmentioned."""
    import klevict_cli.bench as bench_module

    def stopped(session, document, settings, progress=None, checkpoint=None, resume=None, note=None):
        checkpoint({"settings": {"windows": settings.windows}, "complete": False, "fidelity": {"windows_done": 1}})
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_module, "run_bench", stopped)
    out = tmp_path / "run.json"
    base = ["bench", "-", "--model", str(tiny_model_dir), "--methods", "snapkv", "--budgets", "50%", "--windows",
            "3", "--context", "64", "--continuation", "8", "--chunk-size", "32", "--out", str(out)]
    result = CliRunner().invoke(app, base, input=TEXT)
    assert result.exit_code == 130 and json.loads(out.read_text())["fidelity"]["windows_done"] == 1
    assert result.stderr.splitlines() == [
        f"note: {out} keeps the windows measured so far (fidelity 1 of 3); the same command with --resume continues",
        "interrupted"]
