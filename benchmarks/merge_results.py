"""Merge `klevict bench` results measured on the same windows (same model, document, seed, context, continuation,
chunk; the windows measured by both) by different runs into one file, e.g. a method added later to an expensive peer run.

    python benchmarks/merge_results.py A.json B.json -o merged.json

Each method comes from the first input that has it; a method in two inputs must have the same numbers in both
(timings aside: the runs are deterministic), else the merge is refused. The full-cache reference and the windows
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


def merge(results: list[dict], names: list[str]) -> dict:
    first = results[0]
    out = json.loads(json.dumps(first))
    out["settings"]["merged_from"] = {names[0]: sorted(first["settings"]["methods"])}
    for name, other in zip(names[1:], results[1:]):
        for key in SAME:
            if _setting(other, key) != _setting(first, key):
                raise SystemExit(f"{name}: setting {key} differs ({other['settings'].get(key)!r} vs "
                                 f"{first['settings'].get(key)!r}); these runs did not measure the same windows")
        for task in TASKS:
            if task not in other:
                continue
            if task not in out:
                raise SystemExit(f"{name} has task {task}, which {names[0]} lacks")
            done = min(out[task].get("windows_done", 0), other[task].get("windows_done", 0))
            if task == "fidelity" and other[task]["offsets"][:done] != out[task]["offsets"][:done]:
                raise SystemExit(f"{name}: different windows")
            for method, per in other[task]["results"].items():
                if method in out[task]["results"]:
                    if measured(per, done) != measured(out[task]["results"][method], done):
                        raise SystemExit(f"{name}: method {method} is in an earlier input, with other numbers")
                    continue  # measured twice, the same (timings aside): the first is kept
                out[task]["results"][method] = per
            cut(out[task], done)
        out["settings"]["methods"] += [m for m in other["settings"]["methods"] if m not in out["settings"]["methods"]]
        out["settings"]["method_params"].update(other["settings"]["method_params"])
        out["settings"]["merged_from"][name] = sorted(other["settings"]["methods"])
        out["complete"] = out.get("complete", True) and other.get("complete", True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    results = [json.loads(p.read_text(encoding="utf-8")) for p in args.inputs]
    merged = merge(results, [p.name for p in args.inputs])
    args.output.write_text(json.dumps(merged, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
