"""benchmarks/merge_results.py: runs of the same windows join; runs stopped at different points are cut to the
windows both measured, with their means recomputed; runs of other windows, or disagreeing numbers, are refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from klevict_cli.results import summary

spec = importlib.util.spec_from_file_location("merge_results",
                                              Path(__file__).parent.parent / "benchmarks" / "merge_results.py")
merge_results = importlib.util.module_from_spec(spec)
spec.loader.exec_module(merge_results)


def run(methods: dict[str, list[float]], windows: int, offsets=(5, 9, 13), budgets=("10%",)) -> dict:
    """A fidelity result in the shape `klevict bench --out` writes, `windows` of them measured (every budget with
    the same numbers, scaled by its position)."""
    def row(values, scale=1):
        per = {"kl": [v * scale for v in values[:windows]], "seconds": [1.0] * windows}
        return {"kl": summary(per["kl"]), "seconds": summary(per["seconds"]), "per_window": per}

    return {
        "settings": {"model": "m", "model_weights_sha256": "w", "document": {"sha256": "d"}, "seed": 0,
                     "context": 64, "continuation": 8, "chunk_size": 32, "probe_window": 8, "dtype": "float32",
                     "methods": list(methods), "budgets": list(budgets),
                     "budget_tokens": {b: 64 // (n + 2) for n, b in enumerate(budgets)},
                     "method_params": {m: {} for m in methods}},
        "complete": windows == len(offsets),
        "fidelity": {"offsets": list(offsets), "windows_done": windows,
                     "full": {"seconds": summary([2.0] * windows), "per_window": {"seconds": [2.0] * windows}},
                     "results": {m: {b: row(v, n + 1) for n, b in enumerate(budgets)} for m, v in methods.items()}},
    }


def test_runs_stopped_at_different_windows_are_cut_to_the_shared_ones():
    peers = run({"snapkv": [0.3, 0.5, 0.7]}, windows=3)
    mine = run({"kl": [0.1, 0.2, 0.9]}, windows=2)
    merged = merge_results.merge([peers, mine], ["peers.json", "kl.json"])
    block = merged["fidelity"]
    assert block["windows_done"] == 2 and merged["complete"] is False
    assert block["results"]["snapkv"]["10%"]["per_window"]["kl"] == [0.3, 0.5]
    assert block["results"]["snapkv"]["10%"]["kl"]["mean"] == pytest.approx(0.4)
    assert block["full"]["per_window"]["seconds"] == [2.0, 2.0] and block["full"]["seconds"]["n"] == 2
    assert merged["settings"]["methods"] == ["snapkv", "kl"]
    assert merged["settings"]["merged_from"] == {"peers.json": ["snapkv"], "kl.json": ["kl"]}


def test_other_windows_or_other_numbers_are_refused():
    with pytest.raises(SystemExit, match="different windows"):
        merge_results.merge([run({"a": [1, 2, 3]}, 2), run({"b": [1, 2, 3]}, 2, offsets=(5, 10, 13))], ["x", "y"])
    with pytest.raises(SystemExit, match="other numbers"):
        merge_results.merge([run({"a": [1, 2, 3]}, 2), run({"a": [1, 2.5, 3]}, 2)], ["x", "y"])
    other = run({"b": [1, 2, 3]}, 2)
    other["settings"]["seed"] = 1
    with pytest.raises(SystemExit, match="seed differs"):
        merge_results.merge([run({"a": [1, 2, 3]}, 2), other], ["x", "y"])


def test_a_document_read_from_another_path_is_the_same_document_another_text_is_not():
    peers, mine = run({"snapkv": [0.3, 0.5, 0.7]}, 3), run({"kl": [0.1, 0.2, 0.9]}, 3)
    peers["settings"]["document"] = {"name": "../data/moby.txt", "sha256": "d", "tokens": 9}
    mine["settings"]["document"] = {"name": "/work/data/moby.txt", "sha256": "d", "tokens": 9}
    assert merge_results.merge([peers, mine], ["p", "m"])["fidelity"]["windows_done"] == 3
    mine["settings"]["document"]["sha256"] = "e"
    with pytest.raises(SystemExit, match="document differs"):
        merge_results.merge([peers, mine], ["p", "m"])


def test_a_rerun_of_some_budgets_supersedes_them_only_when_asked():
    """A rerun of the generous budgets after a change that acts only there, given first: its budgets stand, the
    others come from the run it updates, and the provenance says which came from where."""
    rerun = run({"kl": [0.1, 0.2, 0.3]}, 3, budgets=("50%", "20%"))
    rerun["settings"]["method_params"]["kl"] = {"refit_up_to": "0.15"}
    old = run({"kl": [0.4, 0.5, 0.6]}, 3, budgets=("50%", "20%", "10%"))
    with pytest.raises(SystemExit, match="other numbers"):
        merge_results.merge([rerun, old], ["rerun.json", "kl.json"])
    merged = merge_results.merge([rerun, old], ["rerun.json", "kl.json"], supersede=True)
    rows = merged["fidelity"]["results"]["kl"]
    assert rows["50%"]["per_window"]["kl"] == [0.1, 0.2, 0.3] and rows["20%"]["per_window"]["kl"] == [0.2, 0.4, 0.6]
    assert rows["10%"]["per_window"]["kl"] == pytest.approx([1.2, 1.5, 1.8])
    assert merged["settings"]["budgets"] == ["50%", "20%", "10%"]
    assert list(merged["settings"]["budget_tokens"]) == ["50%", "20%", "10%"]
    assert merged["settings"]["merged_from"] == {"rerun.json": ["kl 50%/20%"], "kl.json": ["kl 10%"]}
    assert merged["settings"]["method_params"]["kl"] == {"refit_up_to": "0.15"}  # the first input's
