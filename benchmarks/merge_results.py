"""Merge `klevict bench` results measured on the same windows (same model, document, seed, context, continuation,
chunk; the windows measured by both) by different runs into one file, e.g. a method added later to an expensive peer run.

    python benchmarks/merge_results.py A.json B.json -o merged.json

Each method and budget comes from the first input that has it; a method and budget in two inputs must have the same
numbers in both (timings aside: the runs are deterministic), else the merge is refused — unless `--supersede`: then
the earlier input's numbers stand (a rerun of some budgets, after a change that acts only at those budgets, given
before the run it updates; every part keeps its own method parameters). The full-cache reference and the windows
come from the first input; only the windows every input measured are kept (runs stopped at different points are cut
to the shortest, and their means recomputed). The merged file records where every method came from.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from klevict_cli.results import resummarise

SAME = ("model", "model_weights_sha256", "document", "seed", "context", "continuation", "chunk_size",
        "probe_window", "dtype")
TASKS = ("fidelity", "needle", "recall")


TIMINGS = ("seconds", "time_ratio", "peak_device_bytes")


def _setting(result: dict, key: str):
    """A setting as it decides what was measured: a document by its text (sha256, tokens), not the path it was
    read from."""
    value = result["settings"].get(key)
    return {k: v for k, v in value.items() if k != "name"} if key == "document" and isinstance(value, dict) else value


def measured(per_budget: dict, windows: int) -> dict:
    """A method's per-window numbers over the first `windows` windows, timings aside (they vary run to run)."""
    return {b: {k: v[:windows] for k, v in row["per_window"].items() if k not in TIMINGS}
            for b, row in per_budget.items()}


def cut(block: dict, windows: int) -> None:
    """Keep the first `windows` windows of a task's block, and recompute every mean and interval from them."""
    rows = [block["full"]] + [row for per in block["results"].values() for row in per.values()]
    for row in rows:
        for key, values in row["per_window"].items():
            del values[windows:]
        resummarise(row)
    block["windows_done"] = windows


def merge(results: list[dict], names: list[str], supersede: bool = False) -> dict:
    first = results[0]
    out = json.loads(json.dumps(first))
    taken = {names[0]: {task: {m: list(per) for m, per in first[task]["results"].items()}
                        for task in TASKS if task in first}}
    for name, other in zip(names[1:], results[1:]):
        for key in SAME:
            if _setting(other, key) != _setting(first, key):
                raise SystemExit(f"{name}: setting {key} differs ({other['settings'].get(key)!r} vs "
                                 f"{first['settings'].get(key)!r}); these runs did not measure the same windows")
        taken[name] = {}
        for task in TASKS:
            if task not in other:
                continue
            if task not in out:
                raise SystemExit(f"{name} has task {task}, which {names[0]} lacks")
            done = min(out[task].get("windows_done", 0), other[task].get("windows_done", 0))
            if task == "fidelity" and other[task]["offsets"][:done] != out[task]["offsets"][:done]:
                raise SystemExit(f"{name}: different windows")
            taken[name][task] = {}
            for method, per in other[task]["results"].items():
                have = out[task]["results"].setdefault(method, {})
                both = {b: row for b, row in per.items() if b in have}
                if not supersede and measured(both, done) != measured({b: have[b] for b in both}, done):
                    raise SystemExit(f"{name}: method {method} is in an earlier input, with other numbers")
                added = [b for b in per if b not in have]  # measured twice: the earlier input's row stands
                have.update({b: per[b] for b in added})
                taken[name][task][method] = added
            cut(out[task], done)
        out["settings"]["methods"] += [m for m in other["settings"]["methods"] if m not in out["settings"]["methods"]]
        out["settings"]["budgets"] += [b for b in other["settings"]["budgets"] if b not in out["settings"]["budgets"]]
        for budget, tokens in other["settings"].get("budget_tokens", {}).items():
            out["settings"].setdefault("budget_tokens", {}).setdefault(budget, tokens)
        for method, params in other["settings"]["method_params"].items():
            out["settings"]["method_params"].setdefault(method, params)
        out["complete"] = out.get("complete", True) and other.get("complete", True)
    out["settings"]["merged_from"] = {name: provenance(out, per_task) for name, per_task in taken.items()}
    return out


def provenance(merged: dict, per_task: dict) -> list[str]:
    """What one input supplied: its methods, each with the budgets it supplied when it did not supply them all."""
    labels = []
    for task, methods in per_task.items():
        for method, budgets in methods.items():
            if not budgets or method in labels:
                continue
            every = list(merged[task]["results"][method])
            labels.append(method if sorted(budgets) == sorted(every) else f"{method} {'/'.join(budgets)}")
    return sorted(labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--supersede", action="store_true",
                        help="where inputs disagree, the earlier one stands (a rerun of some budgets, given first)")
    args = parser.parse_args()
    results = [json.loads(p.read_text(encoding="utf-8")) for p in args.inputs]
    merged = merge(results, [p.name for p in args.inputs], args.supersede)
    args.output.write_text(json.dumps(merged, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
