"""The held-out tolerance runs on sixteen lanes (heldout.sh) beside the same windows read on four: as many of each
earlier run's first windows as the run on sixteen lanes read (a run's first windows are a shorter run's). Per model
and length, the window x
tolerance pairs whose measured KL is within 1.5x of the tolerance, the median measured / asked per tolerance, and
each tolerance's read time over the `--budget 10%` read of the same window (median); then, over every cache of the
runs, the estimate against the measured KL.

    python benchmarks/results/tuning/drift/lanes16/paired.py 'heldout/maxkl-*-s1-*.json' \\
        'benchmarks/results/drift/maxkl-*-s1-*.json'
"""
import glob
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from drift_check import spearman  # noqa: E402

from klevict_cli.results import within_factor  # noqa: E402

SETS = [("smollm2-135m", 512, "SmolLM2-135M · 512"), ("smollm2-135m", 1024, "SmolLM2-135M · 1,024"),
        ("gemma3-270m", 512, "Gemma-3-270M · 512"), ("gemma3-270m", 1024, "Gemma-3-270M · 1,024")]


def load(pattern: str, read: dict | None = None) -> tuple[dict, list[tuple[float, float]], dict]:
    """(model, length) -> {"ratios": tolerance -> measured / asked, "cost": read time ratios}; (estimate, measured)
    of every cache with an estimate; and the windows each (model, length, text) read. `read`: only that many of
    each run's first windows."""
    found, estimates, windows = {}, [], {}
    for path in sorted(glob.glob(pattern)):
        data = json.loads(Path(path).read_text())
        settings, rows = data["settings"], data["fidelity"]["results"]["kl"]
        key = (settings["model"], settings["context"], settings["document"]["sha256"])
        if read is not None and key not in read:  # not read on sixteen lanes
            continue
        n = windows[key] = settings["windows"] if read is None else read[key]
        base = rows["10%"]["per_window"]["seconds"][:n]
        for label, row in rows.items():
            window = row["per_window"]
            estimates += [(e, m) for e, m in list(zip(window.get("estimated_kl", []), window["kl"]))[:n] if e and m > 0]
            if label.startswith("max-kl"):
                asked = float(label.split()[1])
                entry = found.setdefault((settings["model"], settings["context"]), {"ratios": {}, "cost": []})
                entry["ratios"].setdefault(asked, []).extend(m / asked for m in window["kl"][:n])
                entry["cost"] += [a / b for a, b in zip(window["seconds"][:n], base)]
    return found, estimates, windows


if __name__ == "__main__":
    new, new_estimates, read = load(sys.argv[1])
    old, old_estimates, _ = load(sys.argv[2], read)
    print("| model · length | windows × tolerances | within 1.5×, 16 lanes | 4 lanes | measured / asked, median "
          "(0.01 / 0.03 / 0.1) | read time over --budget 10%, 4 → 16 lanes |\n|---|---|---|---|---|---|")
    totals = [0, 0, 0]
    for model, context, name in SETS:
        if (model, context) not in new:
            continue
        fresh, before = new[(model, context)], old[(model, context)]
        ratios = [r for rs in fresh["ratios"].values() for r in rs]
        earlier = [r for rs in before["ratios"].values() for r in rs]
        hits, hits_before = within_factor(ratios), within_factor(earlier)
        totals = [totals[0] + hits, totals[1] + hits_before, totals[2] + len(ratios)]
        medians = " / ".join(f"{statistics.median(fresh['ratios'][t]):.2f}" for t in sorted(fresh["ratios"]))
        print(f"| {name} | {len(ratios)} | {hits} ({hits / len(ratios):.0%}) | {hits_before} "
              f"({hits_before / len(earlier):.0%}) | {medians} | {statistics.median(before['cost']):.2f}× → "
              f"{statistics.median(fresh['cost']):.2f}× |")
    cost = [c for v in new.values() for c in v["cost"]]
    cost_before = [c for v in old.values() for c in v["cost"]]
    print(f"| all | {totals[2]} | {totals[0]} ({totals[0] / totals[2]:.0%}) | {totals[1]} ({totals[1] / totals[2]:.0%})"
          f" | | {statistics.median(cost_before):.2f}× → {statistics.median(cost):.2f}× |")
    for label, pairs in (("4 lanes", old_estimates), ("16 lanes", new_estimates)):
        ratios = [e / m for e, m in pairs]
        print(f"\nestimate against measured, {label}: {len(pairs)} caches, Spearman "
              f"{spearman([e for e, _ in pairs], [m for _, m in pairs]):.3f}, median {statistics.median(ratios):.2f}, "
              f"within 1.5× {within_factor(ratios) / len(ratios):.0%}", end="")
    print()
