"""Held-out windows that share text with a tuning window, and the held-out results without them.

The drift estimate's calibration, its 80 % range and the `--max-kl` search were fitted on windows of seeds 0, 2, 3
and 4 (every result under benchmarks/results/tuning/ with another seed than 1) and judged on seed 1's
(benchmarks/results/drift/). The seeds draw their windows independently, so some seed-1 windows overlap a tuning
window of the same text: their text was seen by the fit. This lists them and writes copies of the held-out results
without those windows (every per-window list cut to the windows kept), for drift_check.py to read. `--tuning`
narrows the tuning results to some folders (e.g. the drift calibration's and its range's recordings):

    python benchmarks/results/tuning/drift/range/clear_of_tuning.py benchmarks/results/drift/*.json --out /tmp/clear \
        [--tuning FOLDER ...]
    python benchmarks/drift_check.py /tmp/clear/drift-*.json /tmp/clear/maxkl-*.json

(`--against` needs the `--budget` results of the same windows: they are cut the same way.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve()
TUNING = HERE.parents[2]  # benchmarks/results/tuning
HELD_OUT_SEED = 1


def text_of(settings: dict) -> str:
    return "hamlet" if "hamlet" in Path(settings["document"]["name"]).stem.lower() else "moby"


def spans(result: dict) -> list[tuple[int, int]]:
    """The text each window of a result reads and teacher-forces: [offset, offset + context + continuation)."""
    fidelity, settings = result["fidelity"], result["settings"]
    length = settings["context"] + settings["continuation"]
    return [(start, start + length) for start in fidelity["offsets"][:fidelity.get("windows_done", 10**9)]]


def tuning_spans(folders: list[Path]) -> dict[tuple[str, str], list[tuple[int, int, str]]]:
    """Per (model, text), every tuning window's span in `folders` and the file it is in."""
    found: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
    for path in sorted(p for folder in folders for p in folder.resolve().rglob("*.json")):
        try:
            result = json.loads(path.read_text())
        except ValueError:
            continue
        if not (isinstance(result, dict) and "settings" in result and "offsets" in result.get("fidelity", {})):
            continue
        settings = result["settings"]
        if settings.get("seed") == HELD_OUT_SEED:
            continue
        key = (settings["model"], text_of(settings))
        found.setdefault(key, []).extend((a, b, str(path.relative_to(TUNING))) for a, b in spans(result))
    return found


def cut(result: dict, keep: list[int]) -> dict:
    """`result` with every per-window list reduced to the windows `keep` (indices)."""
    out = json.loads(json.dumps(result))
    fidelity = out["fidelity"]
    fidelity["offsets"] = [fidelity["offsets"][i] for i in keep]
    fidelity["windows_done"] = len(keep)
    for rows in [fidelity.get("full", {})] + [row for method in fidelity["results"].values()
                                               for row in method.values()]:
        window = rows.get("per_window", {})
        for key, values in window.items():
            if isinstance(values, list):
                window[key] = [values[i] for i in keep]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="folder for the cut copies")
    parser.add_argument("--tuning", nargs="+", type=Path, default=[TUNING],
                        help="folders of tuning results (default: all of benchmarks/results/tuning/)")
    args = parser.parse_args()
    tuning = tuning_spans(args.tuning)
    args.out.mkdir(parents=True, exist_ok=True)
    total = dropped = 0
    for path in args.results:
        result = json.loads(path.read_text())
        settings = result["settings"]
        seen = tuning.get((settings["model"], text_of(settings)), [])
        keep, notes = [], []
        for i, (a, b) in enumerate(spans(result)):
            hits = [f"{name} [{c}, {d})" for c, d, name in seen if a < d and c < b]
            if hits:
                notes.append(f"  window {i} [{a}, {b}) overlaps {len(hits)} tuning window(s), e.g. {hits[0]}")
            else:
                keep.append(i)
        total += len(spans(result))
        dropped += len(spans(result)) - len(keep)
        print(f"{path.name}: {len(keep)} of {len(spans(result))} windows clear of tuning text")
        for line in notes:
            print(line)
        (args.out / path.name).write_text(json.dumps(cut(result, keep)))
    print(f"all: {total - dropped} of {total} held-out windows clear of every tuning window")


if __name__ == "__main__":
    main()
