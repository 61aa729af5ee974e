"""How well each cache's estimated drift (its last eviction measured on drafts, `Engine.measure_drift`) predicts the
KL the bench measured on the text that really follows, per window and budget.

    python benchmarks/drift_check.py benchmarks/results/drift/*.json

Prints, per result file and method, the pairs' Spearman correlation, the median and spread of estimated / measured,
and the share of pairs within a factor 1.5; then the same over every pair of every file.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for rank, i in enumerate(order):
        out[i] = float(rank)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def pairs(result: dict, method: str) -> list[tuple[float, float]]:
    out = []
    for row in result["fidelity"]["results"][method].values():
        window = row["per_window"]
        out += [(e, m) for e, m in zip(window.get("estimated_kl", []), window["kl"]) if e is not None and m > 0]
    return out


def describe(label: str, found: list[tuple[float, float]]) -> str:
    if len(found) < 3:
        return f"| {label} | {len(found)} | | | | |"
    ratios = sorted(e / m for e, m in found)
    q = statistics.quantiles(ratios, n=10, method="inclusive")
    within = sum(1 / 1.5 <= r <= 1.5 for r in ratios) / len(ratios)
    return (f"| {label} | {len(found)} | {spearman(*map(list, zip(*found))):.3f} | {statistics.median(ratios):.2f} | "
            f"{q[0]:.2f}–{q[-1]:.2f} | {100 * within:.0f} % |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    args = parser.parse_args()
    print("| result · method | pairs | Spearman | median est./measured | 10–90 % | within 1.5× |\n|---|---|---|---|---|---|")
    everything: dict[str, list] = {}
    for path in args.results:
        result = json.loads(path.read_text())
        settings = result["settings"]
        for method in result["fidelity"]["results"]:
            found = pairs(result, method)
            everything.setdefault(method, []).extend(found)
            label = f"{Path(settings['document']['name']).stem} {settings['context']} {settings['model']} · {method}"
            print(describe(label, found))
    for method, found in everything.items():
        print(describe(f"all · {method}", found))
    print(describe("all", [p for found in everything.values() for p in found]))


if __name__ == "__main__":
    main()
