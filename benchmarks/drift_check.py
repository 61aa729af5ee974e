"""How well each cache's estimated drift (`Engine.measure_drift`) predicts the KL the bench measured on the text
that really follows, per window and budget; and, for results with `--max-kl` tolerances, how close the measured KL
came to the tolerance asked for.

    python benchmarks/drift_check.py benchmarks/results/drift/*.json
    python benchmarks/drift_check.py benchmarks/results/drift/maxkl-*.json --plot docs/img/max-kl.png

Prints, per result file and method, the pairs' Spearman correlation, the median and spread of estimated / measured,
and the share of pairs within a factor 1.5; then the same over every pair of every file. Then, per file and
tolerance, the kept share and measured / asked over the windows, and the share within 1.5× (pooled at the end).
`--plot` draws measured against asked for every file with tolerances (needs matplotlib). `--truth own` measures
against the KL on the model's own continuations instead (results of `bench --sampled`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

from klevict_cli.results import RESAMPLES, tolerances, within_factor  # noqa: E402

TRUTHS = {"page": "kl", "own": "kl_sampled"}  # --truth: the per-window numbers each names


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


def pairs(result: dict, method: str, truth: str = "kl") -> list[tuple[float, float]]:
    out = []
    for row in result["fidelity"]["results"][method].values():
        window = row["per_window"]
        out += [(e, m) for e, m in zip(window.get("estimated_kl", []), window[truth]) if e is not None and m > 0]
    return out


def describe(label: str, found: list[tuple[float, float]]) -> str:
    if len(found) < 3:
        return f"| {label} | {len(found)} | | | | |"
    ratios = sorted(e / m for e, m in found)
    q = statistics.quantiles(ratios, n=10, method="inclusive")
    within = within_factor(ratios) / len(ratios)
    return (f"| {label} | {len(found)} | {spearman(*map(list, zip(*found))):.3f} | {statistics.median(ratios):.2f} | "
            f"{q[0]:.2f}–{q[-1]:.2f} | {100 * within:.0f} % |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path, help="draw measured against asked for the results with tolerances")
    parser.add_argument("--against", nargs="+", type=Path, default=[],
                        help="`--budget` results of the same windows at the tolerances' mean sizes, largest first")
    parser.add_argument("--truth", choices=sorted(TRUTHS), default="page",
                        help="what the KL is measured on: the real next page (the bench's kl) or the model's own "
                             "continuations (kl_sampled, from bench --sampled)")
    args = parser.parse_args()
    truth = TRUTHS[args.truth]
    print("| result · method | pairs | Spearman | median est./measured | 10–90 % | within 1.5× |\n|---|---|---|---|---|---|")
    everything: dict[str, list] = {}
    found_results = loaded(args.results)
    for result in found_results.values():
        settings = result["settings"]
        for method in result["fidelity"]["results"]:
            found = pairs(result, method, truth)
            everything.setdefault(method, []).extend(found)
            label = f"{Path(settings['document']['name']).stem} {settings['context']} {settings['model']} · {method}"
            print(describe(label, found))
    for method, found in everything.items():
        print(describe(f"all · {method}", found))
    print(describe("all", [p for found in everything.values() for p in found]))
    asked = {name(result): result for result in found_results.values() if tolerances(result)}
    if asked:
        print(tolerance_table(asked, truth))
    if args.against:
        print(equal_size_table(asked, {name(r): r for r in loaded(args.against).values()}, truth))
    if args.plot and asked:
        from klevict_cli.plots import figure_bytes, tolerance_figure

        args.plot.write_bytes(figure_bytes(tolerance_figure(asked), args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)


def loaded(paths: list[Path]) -> dict[Path, dict]:
    return {path: json.loads(path.read_text()) for path in paths}


def name(result: dict) -> str:
    """A result's label: its model, length, text and seed (results of one text at two seeds are two results)."""
    settings = result["settings"]
    return f"{settings['model']} {settings['context']} {Path(settings['document']['name']).stem} seed {settings['seed']}"


def tolerance_table(asked: dict[str, dict], truth: str = "kl") -> str:
    """Per result and tolerance: kept share, measured / asked (median, range) and windows within 1.5× of it."""
    lines = ["", "| result · tolerance | windows | kept | measured / asked: median | range | within 1.5× |",
             "|---|---|---|---|---|---|"]
    pooled: dict[float, list[float]] = {}
    for label, result in asked.items():
        for rows in result["fidelity"]["results"].values():
            for column, tolerance in tolerances(result).items():
                window = rows[column]["per_window"]
                ratios = sorted(kl / tolerance for kl in window[truth])
                pooled.setdefault(tolerance, []).extend(ratios)
                kept = window["cache_fraction"]
                lines.append(f"| {label} · {tolerance:g} | {len(ratios)} | "
                             f"{100 * min(kept):.0f}–{100 * max(kept):.0f} % "
                             f"| {statistics.median(ratios):.2f} | {ratios[0]:.2f}–{ratios[-1]:.2f} | "
                             f"{within(ratios)} |")
    for tolerance, ratios in sorted(pooled.items()):
        ratios.sort()
        lines.append(f"| all · {tolerance:g} | {len(ratios)} | | {statistics.median(ratios):.2f} | "
                     f"{ratios[0]:.2f}–{ratios[-1]:.2f} | {within(ratios)} |")
    every = sorted(r for ratios in pooled.values() for r in ratios)
    lines.append(f"| all | {len(every)} | | {statistics.median(every):.2f} | {every[0]:.2f}–{every[-1]:.2f} | "
                 f"{within(every)} |")
    return "\n".join(lines)


def equal_size_table(asked: dict[str, dict], sized: dict[str, dict], truth: str = "kl") -> str:
    """Per model and length (both texts' windows together): each tolerance's mean kept share and measured KL against
    those of the `--budget` read of the same windows whose size matches it (budget columns largest first, tolerances
    smallest first)."""
    groups: dict[str, dict[str, list]] = {}
    for label, result in asked.items():
        if label not in sized:
            continue
        model, context, _ = label.split(" ", 2)
        if result["fidelity"]["offsets"] != sized[label]["fidelity"]["offsets"]:
            raise SystemExit(f"{label}: the --budget result read other windows")
        rows, budget_rows = result["fidelity"]["results"]["kl"], sized[label]["fidelity"]["results"]["kl"]
        for n, (column, tolerance) in enumerate(sorted(tolerances(result).items(), key=lambda item: item[1])):
            budget = list(budget_rows)[n]
            entry = groups.setdefault(f"{model} {context} · {tolerance:g} · {budget}", {"a": [], "b": []})
            entry["a"] += zip(rows[column]["per_window"]["cache_fraction"], rows[column]["per_window"][truth])
            entry["b"] += zip(budget_rows[budget]["per_window"]["cache_fraction"],
                              budget_rows[budget]["per_window"][truth])
    lines = ["", "| model · length · tolerance · budget | windows | kept: tolerance / budget | mean KL: tolerance / "
                 "budget | ratio [95 %] |", "|---|---|---|---|---|"]
    for label, entry in groups.items():
        kept_a, kl_a = (statistics.fmean(x) for x in zip(*entry["a"]))
        kept_b, kl_b = (statistics.fmean(x) for x in zip(*entry["b"]))
        low, high = ratio_of_means_interval([kl for _, kl in entry["a"]], [kl for _, kl in entry["b"]])
        lines.append(f"| {label} | {len(entry['a'])} | {100 * kept_a:.1f} / {100 * kept_b:.1f} % | {kl_a:.4f} / "
                     f"{kl_b:.4f} | {kl_a / kl_b:.2f}× [{low:.2f}, {high:.2f}] |")
    return "\n".join(lines)


def ratio_of_means_interval(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of mean(a) / mean(b), the windows resampled in pairs: the issue compares
    mean KLs, which a few hard windows dominate, so the interval says how much of a ratio the draw of windows allows."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(RESAMPLES):
        picks = rng.choices(range(len(a)), k=len(a))
        ratios.append(sum(a[i] for i in picks) / sum(b[i] for i in picks))
    ratios.sort()
    return ratios[int(0.025 * (RESAMPLES - 1))], ratios[int(0.975 * (RESAMPLES - 1))]


def within(ratios: list[float]) -> str:
    inside = within_factor(ratios)
    return f"{inside} of {len(ratios)} ({100 * inside / len(ratios):.0f} %)"


if __name__ == "__main__":
    main()
