"""Benchmark tables (klevict_cli/results.py, benchmarks/make_tables.py) and plots (`bench --plot`), from a real
`run_bench` result on a tiny random model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from klevict_cli.bench import BenchSettings, run_bench
from klevict_cli.documents import Document
from klevict_cli import results
from klevict_cli.packaged import DEFAULT_MODEL
from klevict_cli.results import accuracy_text, md, paired_ratio, peers, wilson
from tests.conftest import CORPUS, tiny_session
from tests.test_cli import assert_error, assert_ok, invoke

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("make_tables", ROOT / "benchmarks" / "make_tables.py")
make_tables = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(make_tables)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def result() -> dict:
    session = tiny_session()
    settings = BenchSettings(methods=["kl", "snapkv", "streaming", "kl-layer"], budgets=["50%", "20%"], windows=3,
                             context=200, continuation=32, chunk_size=64, probe_window=8, task="both", needles=2,
                             answer_tokens=4)
    document = Document(" ".join(CORPUS * 25), "corpus | <b>.txt", "0" * 64)
    return json.loads(json.dumps(run_bench(session, document, settings)))


def tree(tmp_path: Path, results: dict[str, object]) -> Path:
    """A copy of the repository's two generated files (with their markers) and the given result files."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    for name in ("README.md", "docs/benchmarks.md"):
        (tmp_path / name).write_text((ROOT / name).read_text(encoding="utf-8"), encoding="utf-8")
    for name, data in results.items():
        (tmp_path / "benchmarks" / "results" / name).write_text(json.dumps(data), encoding="utf-8")
    return tmp_path


def generated(root: Path, name: str, marks: tuple[str, str]) -> str:
    text = (root / name).read_text(encoding="utf-8")
    return text.split(marks[0])[1].split(marks[1])[0]


# ---- statistics ------------------------------------------------------------------------------------------------
def test_paired_ratio_of_a_constant_ratio_is_exact():
    p = paired_ratio([1.0, 2.0, 4.0], [2.0, 4.0, 8.0])
    assert p["ratio"] == pytest.approx(0.5) and p["low"] == pytest.approx(0.5) and p["high"] == pytest.approx(0.5)
    assert (p["better"], p["windows"]) == (3, 3)


def test_paired_ratio_interval_holds_the_mean_and_skips_zeros():
    p = paired_ratio([1.0, 3.0, 0.0, 2.0], [2.0, 2.0, 0.0, 1.0])
    assert p["paired"] == 3 and p["better"] == 1 and p["windows"] == 4
    assert p["low"] <= p["ratio"] <= p["high"]
    assert p["ratio"] == pytest.approx((0.5 * 1.5 * 2.0) ** (1 / 3))


def test_wilson_interval_and_accuracy_against_the_full_cache():
    low, high = wilson(0, 40)
    assert low == 0.0 and 0.08 < high < 0.09  # 0 of 40: up to 8.8 %
    low, high = wilson(20, 40)
    assert low < 0.5 < high and high - 0.5 == pytest.approx(0.5 - low)
    text = accuracy_text([[True, False], [True, True]], full=[[True, True], [True, True]])
    assert text.startswith("3/4 = 75 % [") and text.endswith("(0.75× full)")
    assert accuracy_text([[True]], full=[[True, False], [False, False]]) == "1/1 = 100 % [21, 100] (1.00× full)"


def test_peers_leave_out_kl_and_its_variants():
    assert peers(["kl", "kl-layer", "kl-fisher", "snapkv", "kvzip"]) == ["snapkv", "kvzip"]


def test_text_from_a_file_cannot_open_markup_or_split_a_cell():
    assert md("a|b <script>`x`*y*") == "a\\|b \\<script\\>\\`x\\`\\*y\\*"


# ---- the script ------------------------------------------------------------------------------------------------
def test_tables_from_a_result_file(tmp_path, result):
    root = tree(tmp_path, {"tiny.json": result, "cost.json": {"pairs": [1.2]}})
    assert make_tables.main(["--root", str(root)]) == 0
    docs = generated(root, "docs/benchmarks.md", make_tables.TABLES)
    assert "### tiny.json" in docs
    assert ("klevict bench 'corpus | <b>.txt' --model tiny-llama --methods kl,snapkv,streaming,kl-layer --budgets "
            "50%,20% --windows 3 --context 200 --continuation 32 --seed 0") in docs
    assert "--out benchmarks/results/tiny.json" in docs
    for method in ("kl", "snapkv", "streaming", "kl-layer"):
        assert docs.count(f"\n| {method} | ") == 4  # KL, top-1, cost, needle
    kl = result["fidelity"]["results"]["kl"]["50%"]["kl"]["mean"]
    assert f"{kl:.3g}"[:5] in docs
    assert "`benchmarks/results/cost.json`" in docs  # listed, not tabulated
    assert "document `corpus \\| \\<b\\>.txt`" in docs
    readme = generated(root, "README.md", make_tables.HEADLINE)
    best = min(("snapkv", "streaming"), key=lambda m: result["fidelity"]["results"][m]["20%"]["kl"]["mean"])
    assert f"| 20% | " in readme and best in readme and "`benchmarks/results/tiny.json`" in readme
    assert "kl-layer" not in readme.split("Cost:")[0].split("\n| 20%")[1]  # a variant is not "another method"
    assert make_tables.main(["--root", str(root), "--check"]) == 0


def test_the_headline_pools_the_same_measurement_on_several_texts(tmp_path, result):
    other = json.loads(json.dumps(result))
    other["settings"]["document"]["name"] = "/some/where/hamlet.md"
    for per in other["fidelity"]["results"].values():  # another text: other numbers
        for row in per.values():
            row["per_window"]["kl"] = [2 * x for x in row["per_window"]["kl"]]
    root = tree(tmp_path, {"moby.json": result, "hamlet.json": other})
    assert make_tables.main(["--root", str(root)]) == 0
    readme = generated(root, "README.md", make_tables.HEADLINE)
    assert "`benchmarks/results/hamlet.json`, `benchmarks/results/moby.json`" in readme
    assert "6 windows of 200 tokens of `hamlet.md` and `corpus \\| \\<b\\>.txt`" in readme
    pooled = results.pool([result, other])
    kl = pooled["fidelity"]["results"]["kl"]["20%"]
    assert kl["per_window"]["kl"] == result["fidelity"]["results"]["kl"]["20%"]["per_window"]["kl"] + [
        2 * x for x in result["fidelity"]["results"]["kl"]["20%"]["per_window"]["kl"]]
    mean = result["fidelity"]["results"]["kl"]["20%"]["kl"]["mean"]
    assert kl["kl"]["n"] == 6 and kl["kl"]["mean"] == pytest.approx(1.5 * mean)
    changed = json.loads(json.dumps(other))
    changed["settings"]["context"] = 100  # measured otherwise: never pooled
    assert len(results.headline_choice({Path("a.json"): result, Path("b.json"): changed})) == 1


def test_the_headline_goes_to_the_latest_of_two_equal_runs(result):
    """Two runs of the same comparison on as many windows (another seed's): the later one is the headline, whatever
    the files' names."""
    rerun = json.loads(json.dumps(result))
    rerun["settings"]["seed"] = 11
    rerun["settings"]["created"] = "2999-01-01T00:00:00+00:00"
    found = {Path("z-first.json"): result, Path("a-rerun.json"): rerun}
    assert results.headline_choice(found) == [Path("a-rerun.json")]
    rerun["settings"]["created"] = "1999-01-01T00:00:00+00:00"
    assert results.headline_choice(found) == [Path("z-first.json")]


def test_check_fails_when_a_result_changes(tmp_path, result):
    root = tree(tmp_path, {"tiny.json": result})
    assert make_tables.main(["--root", str(root)]) == 0
    changed = json.loads(json.dumps(result))
    changed["settings"]["seed"] = 7
    (root / "benchmarks/results/tiny.json").write_text(json.dumps(changed), encoding="utf-8")
    assert make_tables.main(["--root", str(root), "--check"]) == 1


def test_no_results_is_said_plainly(tmp_path):
    root = tree(tmp_path, {})
    assert make_tables.main(["--root", str(root)]) == 0
    assert "No results are committed" in generated(root, "docs/benchmarks.md", make_tables.TABLES)
    assert "No benchmark results are committed yet" in generated(root, "README.md", make_tables.HEADLINE)


def test_the_repository_tables_are_current():
    """docs/benchmarks.md and the README headline are what benchmarks/results/ gives: after adding a result, run
    python benchmarks/make_tables.py."""
    assert make_tables.main(["--check"]) == 0


# ---- plots -----------------------------------------------------------------------------------------------------
def test_plot_has_a_panel_per_measure(result):
    pytest.importorskip("matplotlib")
    from klevict_cli.plots import figure, plot_bytes

    fig = figure(result)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 3 and titles[1] == "cost against quality" and titles[2].startswith("needle")
    assert len(fig.axes[0].get_lines()) >= 4  # a line (and error bars) per method
    # retrieval against the full cache's score (a dashed line, named once in the figure's legend), with intervals
    full = 100 * result["needle"]["full"]["accuracy"]["mean"]
    assert [line.get_ydata()[0] for line in fig.axes[2].get_lines() if line.get_label() == "full cache"] == [full]
    assert fig.axes[2].collections  # the error bars
    assert [t.get_text() for t in fig.legends[0].get_texts()].count("full cache") == 1
    assert plot_bytes(result, Path("x.png")).startswith(b"\x89PNG\r\n\x1a\n")
    assert plot_bytes(result, Path("x.svg")).lstrip().startswith(b"<?xml")


def test_tolerances_get_a_panel_of_measured_against_asked():
    """A result with --max-kl columns: a third fidelity panel with one point per window and tolerance (the sized
    budgets' panels unchanged), and the pooled figure of several results draws them all."""
    pytest.importorskip("matplotlib")
    from klevict_cli.plots import figure, tolerance_figure

    settings = BenchSettings(methods=["kl"], budgets=["20%"], windows=2, context=160, continuation=16,
                             chunk_size=64, probe_window=8, task="fidelity", max_kl=[0.05, 10.0])
    document = Document(" ".join(CORPUS * 25), "corpus.txt", "0" * 64)
    result = json.loads(json.dumps(run_bench(tiny_session(), document, settings)))
    assert results.tolerances(result) == {"max-kl 0.05": 0.05, "max-kl 10": 10.0}
    fig = figure(result)
    panel = fig.axes[2]
    assert [ax.get_title() for ax in fig.axes][2] == "measured against asked, 2 windows"
    points = next(c for c in panel.collections if c.get_label() == "kl").get_offsets()
    measured = [kl for label in ("max-kl 0.05", "max-kl 10")
                for kl in result["fidelity"]["results"]["kl"][label]["per_window"]["kl"]]
    assert len(points) == 4 and sorted(points[:, 1].tolist()) == pytest.approx(sorted(measured))
    assert len(fig.axes[0].get_lines()) >= 1  # the budgets' panel still drawn
    pooled = tolerance_figure({"a": result, "b": result})
    assert [len(c.get_offsets()) for c in pooled.axes[0].collections if c.get_label() in ("a", "b")] == [4, 4]


def test_bench_plot_end_to_end(tiny_model_dir, tmp_path):
    pytest.importorskip("matplotlib")
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(CORPUS * 12), encoding="utf-8")
    out = tmp_path / "bench.png"
    result = invoke("bench", doc, "--model", tiny_model_dir, "--methods", "kl,snapkv", "--budgets", "50%",
                    "--windows", "1", "--context", "96", "--continuation", "16", "--chunk-size", "32",
                    "--plot", out)
    assert_ok(result)
    assert out.read_bytes().startswith(b"\x89PNG") and f"wrote {out}" in result.stderr


def test_bench_takes_the_reading_options_from_a_config_and_names_the_keys_it_ignores(tiny_model_dir, tmp_path):
    doc, config = tmp_path / "doc.txt", tmp_path / "k.yaml"
    doc.write_text(" ".join(CORPUS * 12), encoding="utf-8")
    config.write_text("chunk_size: 32\nmax_kl: 0.05\nreconstruct: true\n")  # a compress config's keys, too
    result = invoke("bench", doc, "--model", tiny_model_dir, "--methods", "kl", "--budgets", "50%", "--windows", "1",
                    "--context", "96", "--continuation", "16", "--config", config, "--json")
    assert_ok(result)
    settings = json.loads(result.stdout)["settings"]
    assert settings["chunk_size"] == 32 and settings["max_kl"] == [] and settings["reconstruct"] is False
    assert f"bench ignores max_kl, reconstruct in {config}" in result.stderr


def test_bench_plot_without_matplotlib_names_the_extra_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = invoke("bench", tmp_path / "missing.txt", "--plot", tmp_path / "b.png")
    assert_error(result, 2, "matplotlib", "pip install 'klevict[plot]'")


def test_bench_plot_needs_a_known_format(tmp_path):
    assert_error(invoke("bench", tmp_path / "missing.txt", "--plot", tmp_path / "b.gif"), 2, ".png")


def test_the_length_sweep_gets_a_table_of_its_own_and_stays_out_of_the_headline(tmp_path, result):
    """lengths-TEXT-LENGTH[-MODEL].json files (benchmarks/lengths.sh) make the quality-against-length table: one row
    per context length, model and budget, the texts of a length pooled, the default model's rows first and other
    models named; the README's headline keeps to the other results."""
    sweep = json.loads(json.dumps(result))
    del sweep["needle"]  # the sweep measures fidelity only
    fid = sweep["fidelity"]["results"]
    fid["kl-reconstruct"] = json.loads(json.dumps(fid["kl"]))
    for row in fid["kl-reconstruct"].values():
        row["per_window"]["kl"] = [3 * x for x in row["per_window"]["kl"]]
        results.resummarise(row)
    sweep["settings"]["model"] = DEFAULT_MODEL
    longer = json.loads(json.dumps(sweep))
    longer["settings"]["context"] = 400
    other = json.loads(json.dumps(sweep))
    other["settings"]["model"] = "gemma3-270m"
    root = tree(tmp_path, {"plain.json": result, "lengths-corpus-200.json": sweep, "lengths-corpus-400.json": longer,
                           "lengths-corpus-200-gemma3-270m.json": other})
    assert make_tables.main(["--root", str(root)]) == 0
    table = generated(root, "docs/benchmarks.md", make_tables.LENGTHS)
    assert table.count("\n| 200 | ") == 2 and table.count("\n| 400 | ") == 2  # 50 % and 20 % at each length
    assert table.count("\n| 200 (gemma3-270m) | ") == 2 and table.index("| 400 |") < table.index("(gemma3-270m)")
    best = min(("snapkv", "streaming"), key=lambda m: fid[m]["20%"]["kl"]["mean"])
    ratio = paired_ratio(fid["kl"]["20%"]["per_window"]["kl"], fid[best]["20%"]["per_window"]["kl"])
    assert f"{ratio['ratio']:.3f}" in table.split("\n| 200 | 20% |")[1].split("\n")[0]
    assert "`benchmarks/results/lengths-corpus-400.json`" in table
    readme = generated(root, "README.md", make_tables.HEADLINE)
    assert "`benchmarks/results/plain.json`" in readme and "lengths-" not in readme
    assert make_tables.main(["--root", str(root), "--check"]) == 0


def test_a_length_measured_without_the_compress_reading_says_so(tmp_path, result):
    """A length where kl-reconstruct was not measured on every text (a long sweep stopped part way) still gets its
    rows, kl against the peers, and says what is missing instead of leaving the length out."""
    sweep = json.loads(json.dumps(result))
    del sweep["needle"]
    sweep["settings"].update(model=DEFAULT_MODEL, context=300)
    complete = json.loads(json.dumps(sweep))
    complete["fidelity"]["results"]["kl-reconstruct"] = json.loads(json.dumps(sweep["fidelity"]["results"]["kl"]))
    root = tree(tmp_path, {"lengths-a-300.json": sweep, "lengths-b-300.json": complete})
    assert make_tables.main(["--root", str(root)]) == 0
    rows = [r for r in generated(root, "docs/benchmarks.md", make_tables.LENGTHS).splitlines() if r.startswith("| 300 |")]
    assert len(rows) == 2 and all("| not measured | — |" in r for r in rows)
    assert all(r.split("|")[4].strip().endswith(" of 6") for r in rows)  # kl: both texts' 3 windows each, pooled


def test_quantized_caches_get_a_bytes_table_and_a_frontier_plot(tmp_path):
    """quantized-TEXT-LENGTH.json (bench --cache-dtype: rows "kl <dtype>") and quantized-bytes-TEXT-LENGTH.json
    (bench --max-bytes) make the bytes section: every dtype at every kept share with its bytes, the dtypes at equal
    bytes against float16, and what --max-bytes chose against the best fixed pair within it; plus one plot."""
    session = tiny_session()
    document = Document(" ".join(CORPUS * 25), "corpus.txt", "0" * 64)
    base = dict(methods=["kl"], windows=2, context=200, continuation=16, chunk_size=64, probe_window=8)
    frontier = run_bench(session, document, BenchSettings(**base, budgets=["50%", "30%", "10%"],
                                                          cache_dtypes=["float16", "int8", "int4"]))
    limits = run_bench(session, document, BenchSettings(**base, budgets=["10%"], max_bytes=["5%"]))
    root = tree(tmp_path, {"quantized-corpus-200.json": json.loads(json.dumps(frontier)),
                           "quantized-bytes-corpus-200.json": json.loads(json.dumps(limits))})
    assert make_tables.main(["--root", str(root)]) == 0
    section = generated(root, "docs/benchmarks.md", make_tables.QUANTIZED)
    for dtype in ("float16", "int8", "int4"):
        assert f"\n| {dtype} | " in section
    assert "\n| 5 % | " in section  # what --max-bytes 5% chose
    assert "--cache-dtype float16,int8,int4" in generated(root, "docs/benchmarks.md", make_tables.TABLES)
    if importlib.util.find_spec("matplotlib"):
        assert (root / make_tables.FRONTIER).stat().st_size > 0
    assert make_tables.main(["--root", str(root), "--check"]) == 0
