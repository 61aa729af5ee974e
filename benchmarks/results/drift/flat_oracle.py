"""How much of `--max-kl`'s scatter a better allocation could remove: per window, the cache a tolerance asks for
(the smallest size whose *estimated* drift is within it, both the estimate and the measured KL interpolated log-log
between the window's budgets), shrunk toward one flat size per model, length and tolerance — the geometric mean of
the windows' own choices, an oracle no read has — by a weight lambda (1: the estimate alone, 0: the flat size alone).
Prints, per lambda, how many window x tolerance pairs measure within 1.5x of the tolerance, and the mean measured KL
against the flat size's. Run from the repository root on bench results made with --estimate:

    python benchmarks/results/drift/flat_oracle.py benchmarks/results/drift/drift-*-s1-*.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys

TOLERANCES = (0.01, 0.03, 0.1)


def windows(path: str) -> list[tuple[tuple, list[tuple[int, float, float]]]]:
    """(model, context) and each window's (kept entries, estimated, measured) by kept size, per method."""
    result = json.load(open(path))
    settings, fidelity = result["settings"], result["fidelity"]
    out = []
    for per in fidelity["results"].values():
        for w in range(len(fidelity["offsets"])):
            points = sorted((row["per_window"]["kept_entries"][w], row["per_window"]["estimated_kl"][w],
                             row["per_window"]["kl"][w]) for row in per.values() if w < len(row["per_window"]["kl"]))
            points = [p for p in points if p[1] and p[2]]
            if len(points) >= 3:
                out.append(((settings["model"], settings["context"]), points))
    return out


def at(xs: list[float], ys: list[float], x: float) -> float:
    """ys at x, log-log between the two points around it (the end segments extended, within their slope)."""
    lx, ly, t = [math.log(v) for v in xs], [math.log(v) for v in ys], math.log(x)
    i = min(max(j for j in range(len(lx) - 1) if lx[j] <= t or j == 0), len(lx) - 2)
    share = min(max((t - lx[i]) / (lx[i + 1] - lx[i]) if lx[i + 1] != lx[i] else 0.0, 0.0), 1.0)
    return math.exp(ly[i] + share * (ly[i + 1] - ly[i]))


def asked(points: list[tuple[int, float, float]], tolerance: float) -> float:
    """The smallest size whose interpolated estimate is within `tolerance` (the largest measured if none is)."""
    sizes, estimates = [p[0] for p in points], [p[1] for p in points]
    low, high = sizes[0], sizes[-1]
    if at(sizes, estimates, low) <= tolerance or at(sizes, estimates, high) > tolerance:
        return low if at(sizes, estimates, low) <= tolerance else high
    for _ in range(60):
        mid = math.sqrt(low * high)
        low, high = (low, mid) if at(sizes, estimates, mid) <= tolerance else (mid, high)
    return high


def main(paths: list[str]) -> None:
    groups: dict[tuple, list] = {}
    for path in paths:
        for key, points in windows(path):
            groups.setdefault(key, []).append(points)
    for weight in (1.0, 0.75, 0.5, 0.25, 0.0):
        within = total = 0
        ratios = []
        for group in groups.values():
            for tolerance in TOLERANCES:
                sizes = [asked(points, tolerance) for points in group]
                flat = math.exp(statistics.fmean(math.log(s) for s in sizes))
                shrunk = [math.exp(weight * math.log(s) + (1 - weight) * math.log(flat)) for s in sizes]
                measured = [at([p[0] for p in points], [p[2] for p in points], s) for points, s in zip(group, shrunk)]
                level = [at([p[0] for p in points], [p[2] for p in points], flat) for points in group]
                within += sum(1 / 1.5 <= m / tolerance <= 1.5 for m in measured)
                total += len(measured)
                ratios.append(statistics.fmean(measured) / statistics.fmean(level))
        print(f"lambda {weight:.2f}: within 1.5x of the tolerance {within}/{total} ({within / total:.0%}); mean "
              f"measured KL over the flat size's, median {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main(sys.argv[1:])
