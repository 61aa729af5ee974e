"""The idle machine's cost of `--max-kl` (cost.sh here): each tolerance's read time over the `--budget 10%` read of
the same window, median and range per seed and pooled; and how far the measured KL of each window and tolerance
moved from the shared-machine runs in heldout/ (those read on one thread, these on two: the sums' order differs).

    python benchmarks/results/tuning/drift/lanes16/heldout/idle/ratios.py [FOLDER [MODEL TAG [LENGTH]]]

FOLDER: where cost.sh wrote its runs (default: here; `OUT=FOLDER bash cost.sh` reads them again elsewhere); MODEL
TAG and LENGTH as cost.sh took them (default smollm2-135m smol 512).
"""
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))
from paired import load  # noqa: E402


def measured(path: Path) -> dict:
    rows = json.loads(path.read_text())["fidelity"]["results"]["kl"]
    return {label: row["per_window"]["kl"] for label, row in rows.items()}


if __name__ == "__main__":
    runs = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    model, tag = sys.argv[2:4] if len(sys.argv) > 3 else ("smollm2-135m", "smol")
    length = int(sys.argv[4]) if len(sys.argv) > 4 else 512
    pooled = []
    for seed in (1, 5):
        found, _, _ = load(str(runs / f"maxkl-{tag}-s{seed}-*-{length}.json"))
        cost = found[(model, length)]["cost"]
        pooled += cost
        print(f"seed {seed}: {len(cost)} reads, --max-kl over --budget 10%: median {statistics.median(cost):.2f}x "
              f"({min(cost):.2f}-{max(cost):.2f})")
        for path in sorted(runs.glob(f"maxkl-{tag}-s{seed}-*-{length}.json")):
            before = HERE.parent / path.name
            now, then = measured(path), measured(before)
            moved = [abs(a / b - 1) for label in now for a, b in zip(now[label], then[label])]
            print(f"  {path.name}: measured KL against heldout/{before.name}: median change {statistics.median(moved):.1%},"
                  f" largest {max(moved):.1%}")
    print(f"pooled: {len(pooled)} reads, median {statistics.median(pooled):.2f}x "
          f"({min(pooled):.2f}-{max(pooled):.2f})")
