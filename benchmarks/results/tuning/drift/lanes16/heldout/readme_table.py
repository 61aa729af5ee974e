"""The README's tolerance table: for each `--max-kl` of the bench results given, the kept share of the cache and the
measured KL (range over windows) and the top-1 agreement with the full cache (mean over windows).

    python benchmarks/results/tuning/drift/lanes16/heldout/readme_table.py FILE.json...
"""
import json
import statistics
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    rows: dict[float, dict[str, list[float]]] = {}
    for path in paths:
        for label, row in json.loads(Path(path).read_text())["fidelity"]["results"]["kl"].items():
            if not label.startswith("max-kl "):
                continue
            found = rows.setdefault(float(label.split()[1]), {"kept": [], "kl": [], "top1": []})
            window = row["per_window"]
            found["kept"] += window["cache_fraction"]
            found["kl"] += window["kl"]
            found["top1"] += window["top1"]
    print("| `--max-kl` | kept | measured KL (nats/token) | top-1 agreement |\n|---|---|---|---|")
    for tolerance, found in sorted(rows.items()):
        print(f"| {tolerance:g} | {100 * min(found['kept']):.0f}–{100 * max(found['kept']):.0f} % | "
              f"{min(found['kl']):.3f}–{max(found['kl']):.3f} | {100 * statistics.fmean(found['top1']):.0f} % |")


if __name__ == "__main__":
    main(sys.argv[1:])
